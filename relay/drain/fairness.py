"""Fairness per tenant (RELAY_FAIRNESS_GROUP): what a group is, and the index its fetch
walks. The fetch itself is relay/sql/drain.sql's `fetch_batch` (steps 4 and 5); the
group of a row is the schema's `outbox_fairness_group`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

KINDS = ("key-prefix", "header")
# A header's name as the sinks carry one (RFC 9110 token characters).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")


@dataclass(frozen=True, slots=True)
class FairnessGroup:
    """`key-prefix:<delimiter>` (the key up to the first delimiter) or `header:<name>`."""

    kind: str
    arg: str

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.arg}"

    def index_name(self, shards: int = 1) -> str:
        """The grouping's index for a shard count: named by a digest of the spec, which
        may hold any character (the index's comment spells it out)."""
        digest = hashlib.sha256(self.spec.encode()).hexdigest()[:10]
        if shards > 1:
            return f"outbox_shards_{shards}_fair_{digest}_idx"
        return f"outbox_fair_{digest}_idx"


def parse(spec: str) -> FairnessGroup:
    """A RELAY_FAIRNESS_GROUP value; ValueError says what is wrong with it."""
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in KINDS:
        raise ValueError(
            f"{spec!r}: key-prefix:<delimiter> (e.g. key-prefix:: for tenant-42:order-7)"
            " or header:<name>"
        )
    if kind == "key-prefix" and not 1 <= len(arg) <= 8:
        raise ValueError(f"{spec!r}: the delimiter is 1 to 8 characters")
    if kind == "header" and not _HEADER_NAME.fullmatch(arg):
        raise ValueError(f"{spec!r}: a header name (letters, digits and !#$%&'*+.^_`|~-)")
    return FairnessGroup(kind, arg)
