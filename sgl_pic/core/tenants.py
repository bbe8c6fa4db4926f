"""Tenants: which isolation namespace a chunked request stores into and reads from.

SGLang keeps tenants apart in its prefix cache by the request's ``extra_key`` (native
API) and ``cache_salt`` (OpenAI API): a request never reuses KV computed under another
key or salt, which closes the timing channel of a fast first token telling one tenant
what another sent. Chunk keys follow the same rule (``sgl_pic.keys``): each names the
namespace of the request that stored it, derived here from those two fields exactly as
SGLang seeds its storage hashes (``storage_namespace_seed``: presence byte and length
prefix per field), so requests without either share the default namespace "".

Sharing is the operator's choice only: ``TenantPolicy.public`` names namespaces whose
chunks any request may read when it asks for the public scope (a request option,
``PUBLIC_SCOPE_OPTION``); a request asking for it where the server names none is
refused. Writes always go to the request's own namespace, so no tenant can place chunks
in the public scope except by sending requests in it.

The namespace is derived on the scheduler side by the gate from the ``Req`` SGLang
built, and travels with the verified marks (``gate.Pending``); nothing a client writes
in the chunk marks can name one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The default namespace: requests with neither an extra key nor a cache salt.
DEFAULT_NAMESPACE = ""
# The per-request option (in the marks' signed "config" object) asking to read the
# public scope besides the request's own namespace.
PUBLIC_SCOPE_OPTION = "public_scope"

_SEED_TAG = b"sgl_pic.tenant-namespace-v1"


def isolation_namespace(extra_key: str | None, cache_salt: str | None) -> str:
    """The namespace (a hex digest, "" for the default) of a request with SGLang's
    ``extra_key`` (the client's own, before the gate adds its policy suffix) and
    ``cache_salt`` (an empty salt is none, as in SGLang's ``Req``)."""
    cache_salt = cache_salt or None
    if extra_key is None and cache_salt is None:
        return DEFAULT_NAMESPACE
    h = hashlib.sha256(_SEED_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        encoded = str(part).encode("utf-8")
        h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return h.hexdigest()


@dataclass(frozen=True)
class TenantPolicy:
    """public: namespaces (``isolation_namespace`` digests) whose chunks any request
    asking for the public scope may read. Empty: no sharing (the default)."""

    public: frozenset[str] = frozenset()

    @classmethod
    def from_names(cls, names: Iterable[str]) -> TenantPolicy:
        """The policy sharing each named namespace: NAME is the namespace of requests whose
        ``cache_salt`` is NAME (no extra key), and of those whose ``extra_key`` is NAME
        (no salt). Raises ValueError on an empty name."""
        public: set[str] = set()
        for name in names:
            if not name or name != name.strip():
                raise ValueError(f"a public namespace needs a non-blank name, got {name!r}")
            public.add(isolation_namespace(None, name))
            public.add(isolation_namespace(name, None))
        return cls(frozenset(public))

    def readable(self, own: str, wants_public: bool) -> tuple[str, ...]:
        """The namespaces a request of ``own`` reads, its own first. Raises
        ``PermissionError`` (with a client-facing message) when it asks for the public
        scope and the server names none."""
        if not wants_public:
            return (own,)
        if not self.public:
            raise PermissionError(
                "this server shares no public chunk namespace (--pic-public-namespaces); "
                f"drop '{PUBLIC_SCOPE_OPTION}'"
            )
        return (own, *sorted(self.public - {own}))


def parse_names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """Namespace names of a flag value: a comma-separated string or a list."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(i).strip() for i in items if str(i).strip())


def tenant_policy(settings: Any) -> TenantPolicy:
    """The server's policy from its settings' ``public_namespaces`` (names, see
    ``TenantPolicy.from_names``); no sharing when the settings have none."""
    return TenantPolicy.from_names(parse_names(getattr(settings, "public_namespaces", None)))
