"""An Enum hashed by identity: members key hot dictionaries, and Enum's own hash is Python."""

from __future__ import annotations

import enum


class FastHashEnum(enum.Enum):
    """Members are singletons compared by identity, so identity hashing is exact."""

    __hash__ = object.__hash__
