"""Routing policies: documents (parse, validate), gates, routing plug-ins, the step
executor and the policy store.

Pure logic over domain types; file reading happens only in the store's load functions.
"""
