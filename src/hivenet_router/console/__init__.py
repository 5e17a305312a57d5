"""The operator's console: a browser page on the public port (`/console/`) and the two small
admin endpoints it reads that the API did not have (the latest requests, the last hour of
traffic).

The page is static (console/static: HTML, CSS and JavaScript written by hand, no build, no
network fetch); every call it makes goes through /admin/* with the administrator key the
operator typed, kept in the tab's sessionStorage. Wired in router/wiring.py when
`--console` is on (the default).
"""
