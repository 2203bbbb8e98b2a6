"""Where the connector's log lines go: where vLLM's go, at vLLM's level, unless the application set up logging.

vLLM configures only its own `vllm` logger (a handler, and VLLM_LOGGING_LEVEL). The connector logs under
`handoff_client`, so in an offline `LLM`, where nothing configures Python's root logger, its INFO lines (the start-up
line naming layers, backend, block size and broker; a load refused) went to Python's last-resort handler, which shows
warnings only. Lending `handoff_client` vLLM's handlers and level puts them beside vLLM's own lines, in its format.
An application that configured the root logger, or `handoff_client` itself, keeps its own setup.
"""

from __future__ import annotations

import logging


def log_through_vllm() -> None:
    """Give the `handoff_client` logger vLLM's handlers and level, once, unless logging is configured already."""
    ours = logging.getLogger("handoff_client")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False  # (vLLM's handler has them now: a root handler added later would print them twice)
