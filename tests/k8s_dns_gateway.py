"""``python -m tests.k8s_dns_gateway DNS_FILE -- GATEWAY_FLAGS...``: the real gateway
(``gateway.__main__.main``), its ``dns:///`` names looked up in a JSON file instead of
the cluster's DNS.

The file maps ``"NAME:PORT"`` to the addresses a headless Service's DNS answer would
give (every ready pod; here each a loopback "pod IP" with its own port). It is read at
every lookup, so a test changes the fleet by rewriting it; a name it lacks does not exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def file_resolver(path: Path):  # noqa: ANN201 - returns gateway.discovery.Resolver
    async def resolve(host: str, port: int) -> list[str]:
        try:
            answers = json.loads(path.read_text())
        except FileNotFoundError as err:  # no DNS at all: a failed lookup, not "no pods"
            raise OSError(f"DNS file {path} is missing") from err
        return list(answers.get(f"{host}:{port}", []))

    return resolve


def main(argv: list[str]) -> int:
    from gateway.__main__ import main as gateway_main

    if len(argv) < 2 or argv[1] != "--":
        print(
            "usage: python -m tests.k8s_dns_gateway DNS_FILE -- GATEWAY_FLAGS...", file=sys.stderr
        )
        return 2
    return gateway_main(argv[2:], resolver=file_resolver(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
