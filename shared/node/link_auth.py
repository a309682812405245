"""How a node authenticates on the core-edge link: the cluster secret, per-node credentials, or both.

Life cycle: a node's CLI calls `link_auth(...)` once at start with its `--secret-file`, `--credential`,
`--authority` and `--revocations`; the result (secret, identity, trust) goes into the node's config and from
there to every connection it opens or accepts (protocol/transport.py `connect` / `serve`). With per-node
credentials (protocol/credentials.py) the secret is optional; without them it is required for a node that
talks to peers. Problems are one-line `ConfigError`s before anything starts.
"""

from __future__ import annotations

from edgecore.protocol.credentials import NodeIdentity, Trust, load_node_credentials
from edgecore.shared.errors import ConfigError
from edgecore.shared.node.secrets import read_secret


def link_auth(secret_file: str | None, credential: str | None, authority: str | None, revocations: str | None,
              needed: bool) -> tuple[bytes | None, NodeIdentity | None, Trust | None]:
    """(cluster secret, this node's credential, whom it trusts); `needed`: the node talks to peers."""
    try:
        identity, trust = load_node_credentials(credential, authority, revocations)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"per-node credentials: {exc}") from None
    return read_secret(secret_file, required=needed and identity is None), identity, trust
