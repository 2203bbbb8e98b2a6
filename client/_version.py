"""The release of handoff-broker this client belongs to, read from the installed package's metadata.

A source tree run without being installed (PYTHONPATH=.) has no metadata: FALLBACK_VERSION says so rather than
guessing a release.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "handoff-broker"
FALLBACK_VERSION = "0+unknown"


def installed_version() -> str:
    """The installed distribution's version (`pip show handoff-broker`), else FALLBACK_VERSION."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return FALLBACK_VERSION


__version__ = installed_version()
