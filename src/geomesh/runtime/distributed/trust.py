"""The run's key and id on one rank, and the rule that a run whose processes span hosts signs its frames.

:func:`establish` is called once when a distributed run is built: it reads the key where payloads already
get theirs (:func:`~geomesh.methods.base.payload_key`: ``reliability.hmac_key_env`` or ``hmac_key_file``),
derives the run id from what every region of one job shares (scenario, method, seed, token budget: the same
hash elastic regions compare in their header), and makes both this process's
:class:`~geomesh.runtime.distributed.frames.RunTrust`.

A run whose ranks or regions are on more than one host must have a key: its frames cross networks, and
without a key nothing proves who sent them. A run is on one host when ``geomesh launch`` started it (every
process on this machine, network namespaces included), or when every address it uses is a loopback address
(``MASTER_ADDR``, unless a world's ranks are all local: ``WORLD_SIZE == LOCAL_WORLD_SIZE``; with elastic
regions also the quorum service, which every region must reach). ``GEOMESH_ALLOW_UNSIGNED=1`` runs
across hosts without a key anyway, with a warning on every rank: for a network that is private end to end.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from urllib.parse import urlsplit

from ... import checkpoint as ckpt
from ...config import ConfigError, ScenarioConfig
from ...methods.base import payload_key
from ..checkpoint_state import run_fingerprint
from .frames import RunTrust, set_run_trust

ALLOW_UNSIGNED_ENV = "GEOMESH_ALLOW_UNSIGNED"
LAUNCHER_ENV = "GEOMESH_LAUNCHER"  # set by `geomesh launch`: every process of the run is on this machine
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str | None) -> bool:
    host = (host or "").strip().strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def off_host_addresses(elastic: bool, lighthouse: str | None) -> list[str]:
    """The addresses this rank uses that are not loopback, when its run may span hosts ([]: one host)."""
    env = os.environ
    if env.get(LAUNCHER_ENV):
        return []
    world, local = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    found = []
    if not is_loopback(env.get("MASTER_ADDR", "127.0.0.1")) and not (world and world == local):
        found.append(f"MASTER_ADDR={env.get('MASTER_ADDR')}")
    if elastic:  # regions that all reach the quorum service over loopback are all on this machine
        from .service import LIGHTHOUSE_ENV

        address = lighthouse or env.get(LIGHTHOUSE_ENV) or ""
        host = urlsplit(address if "://" in address else f"http://{address}").hostname
        if address and not is_loopback(host):
            found.append(f"the quorum service {address}")
    return found


def establish(scenario: ScenarioConfig, method_name: str, seed: int, budget: int, *, elastic: bool,
              lighthouse: str | None = None) -> RunTrust:  # fmt: skip
    """This process's key and run id; a ConfigError when a run that spans hosts has no key (see the module)."""
    key = payload_key(scenario)
    run_id = ckpt.fingerprint_hash(run_fingerprint(scenario, method_name, seed, budget))
    if key is None:
        remote = off_host_addresses(elastic, lighthouse)
        if remote and os.environ.get(ALLOW_UNSIGNED_ENV) != "1":
            raise ConfigError(f"this run spans hosts ({', '.join(remote)}) but has no key: set "
                              f"reliability.hmac_key_env or reliability.hmac_key_file (the same secret on every "
                              f"region), or {ALLOW_UNSIGNED_ENV}=1 to run unsigned on a private network")  # fmt: skip
        if remote:
            print(f"warning: running without a key across hosts ({', '.join(remote)}, {ALLOW_UNSIGNED_ENV}=1): "
                  "frames and healing are not authenticated", file=sys.stderr, flush=True)  # fmt: skip
    return set_run_trust(key, run_id)
