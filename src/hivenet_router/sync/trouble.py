"""What a router says in its log when the site store fails it (sync/site.py): one warning
an outage and one line when the store answers again, an ERROR once a minute while the store
refuses the router's credentials (no outage that ends by itself), and every error in words
an operator can act on (`reason`)."""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger("hivenet_router.sync")  # the site's logger (sync/site.py)

# An object's repr inside an error message (`<valkey.asyncio.client.Valkey(<...>)>`), which
# the store client's errors carry whole and which said nothing an operator could use.
_REPR = re.compile(r"<[^<>]*>")
REASON_CHARS = 300
REFUSED_SAID_EVERY = 60.0  # seconds between the lines on a store refusing the credentials


def reason(error: BaseException) -> str:
    """An error in words for the log: its message without the reprs of the objects it
    names, and the error that caused it where that says more (its "connection refused"
    came after 200 characters of client repr, and a cut at 200 left it out)."""
    parts: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(parts) < 3:
        text = str(seen) or type(seen).__name__
        while (shorter := _REPR.sub("...", text)) != text:
            text = shorter
        text = " ".join(text.split())
        if text and all(text not in part for part in parts):
            parts.append(text)
        seen = seen.__cause__ or seen.__context__
    return "; ".join(parts)[:REASON_CHARS]


class StoreTrouble:
    """The log lines of one router's store failures, each said as often as it helps."""

    __slots__ = ("_outage_said", "_refused_said")

    def __init__(self) -> None:
        self._outage_said = False
        self._refused_said = -REFUSED_SAID_EVERY  # when a refusal of credentials was said

    def failed(self, kind: str, error: BaseException, share: int) -> None:
        """A store step failed with `error`, counted as `kind`; `share` is the part of
        each budget the router admits on meanwhile (1/share)."""
        if kind == "refused":
            # Not an outage that ends by itself: the store turned this router's credentials
            # down (a wrong --sync-password-file, a user without the rights). Said at ERROR,
            # once a minute, for as long as it lasts.
            now = time.monotonic()
            if now - self._refused_said >= REFUSED_SAID_EVERY:
                self._refused_said = now
                log.error(
                    "site store refuses this router's credentials (%s): check "
                    "--sync-password-file and the store's user; until then this router "
                    "admits on its share (1/%d of each budget)",
                    reason(error),
                    share,
                )
            return
        if not self._outage_said:
            self._outage_said = True
            log.warning(
                "site store %s (%s): this router admits on its share (1/%d of each budget) "
                "until it answers",
                "answered with something unexpected" if kind == "bad_reply" else "unreachable",
                reason(error),
                share,
            )

    def answered(self, live: int) -> None:
        """A round went through: the outage said, if one was, is over."""
        if self._outage_said:
            self._outage_said = False
            log.info("site store answers again: %d routers live", live)
