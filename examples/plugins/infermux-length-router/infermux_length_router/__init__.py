"""Reference infermux plugins, packaged the way a team would ship its own.

- ``length-router`` (:mod:`infermux_length_router.length_router`): long prompts to one
  backend, short ones to another.
- ``tenant-tagger`` (:mod:`infermux_length_router.tenant_tagger`): the tenant of an
  unauthenticated request from a request header.

Both do nothing until configured, so installing the package changes no gateway's behaviour
by itself.
"""

from __future__ import annotations

__version__ = "0.1.0"
