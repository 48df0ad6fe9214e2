"""Which exchange a round uses: the cheapest collective for the cluster by the WAN model, or the one a
scenario forces (``geomesh.exchange``).

Candidates, for a payload of P parameters over N regions (:class:`~geomesh.network.WanModel` times them):

- ``all_reduce`` (dense fp32 payloads, DiLoCo, without a run key): a ring, 2(N−1) latency steps, 2(N−1)/N·4P
  bytes per region. With the run's key it is not available: a sum in flight cannot carry each sender's tag, and
  every payload must be checked before it is combined; dense payloads then take the cheaper of the
  ``all_gather`` of whole signed payloads ((N−1)·4P bytes per region) and the ``sharded`` exchange below;
- ``all_gather`` (sign payloads): a ring, N−1 latency steps, (N−1)·P/8 bytes per region, and every region
  combines N payloads (O(N·P) work);
- ``sharded`` (sign payloads, :mod:`geomesh.codec.sharded`): two direct all-to-alls (the 1-bit slices to
  the shards' owners, then the combined shards, ``bits`` bits per element, back to everyone): four latency
  steps (two of them agreements of N flag bytes), (N−1)/N·(P/8 + bits·P/8) bytes per region, and every
  region combines one shard of N slices (O(P));
- ``sharded`` (sparse sign payloads, :mod:`geomesh.codec.sharded_sparse`): the same steps, each region's
  slices its entries in each shard and each combined shard re-sparsified by its owner (or float32 with
  ``bits`` 32, the exact variant): (N−1)/N·(p + c) bytes per region, p a payload and c a combined payload
  (p, or 4·P bytes exact), against the all-gather's (N−1)·p;
- ``sharded`` (dense payloads with a run key, :class:`~geomesh.codec.sharded.ShardedDenseExchange`): the
  signed float32 slices to the owners, the float32 combined shards back: (N−1)/N·(4P + 4P) bytes per region
  plus a header and tag per piece, a ring all-reduce's bytes, in four latency steps.

Sign and sparse payloads take the cheaper of the all-gather and the sharded exchange by modeled time; two
candidates whose times are within :data:`SAME_TIME` of each other are the same time, and the one that moves
fewer bytes wins (the WAN is shared). A sharded exchange that re-sparsifies (sparse payloads, combined shards
not in float32) is timed at :data:`RESPARSIFIED_ROUNDS` of its exchanges against one all-gather: its owners
return one payload's density of the combined update where the all-gather applies the union of N payloads,
and it takes about that many rounds to apply what one all-gather round does. Overlapped rounds (docs/overlap.md)
hide each exchange under the next round's compute, so an exchange is timed by what that compute does not hide
(``hidden_s``, the all-gather round's compute; a re-sparsified round has 1/:data:`RESPARSIFIED_ROUNDS` of it):
two exchanges the rounds hide both cost nothing, and the one with fewer bytes wins. The last overlapped round's
fragments are all-gathered whatever the choice. Pure: numbers in, a choice out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..network import WanModel

EXCHANGE_NAMES = {"all_reduce": "ring all-reduce", "all_gather": "all-gather", "sharded": "sharded exchange"}
# two exchanges whose modeled times differ by less than this fraction take the same time (the WAN model's own
# precision is coarser): the one that moves fewer bytes is chosen
SAME_TIME = 0.01
# rounds through the re-sparsified sharded exchange that deliver what one all-gather round of the same sparse
# payloads does. Measured on `default` (docs/benchmarks.md, issue 36): at equal tokens, rounds of the reference's
# sequences reach 4.6945 all-gathered and 4.7700 re-sparsified (+1.6%, seeds 0-2 alike); re-sparsified rounds of
# half the sequences, twice as many, reach 4.7009. So an exchange that re-sparsifies is timed at two of its
# exchanges against one all-gather: it wins where its bytes are what the round waits for, at many regions or on
# thin links, and not where latency sets an exchange's time and it would only save bytes.
RESPARSIFIED_ROUNDS = 2.0


@dataclass(frozen=True)
class ShardedSizes:
    """Bytes of the sharded exchange for a timing model, as a function of the number of regions N: the
    slices of one payload (its body cut in N, one header each) and the N combined shards."""

    slices_body: float  # the payload's body (magnitudes + sign bits) at the timing model's size
    slice_header: int  # one slice's header (+ its HMAC tag)
    combined_body: float  # all combined shards' bodies (codes + per-chunk ranges) at the timing model's size
    combined_header: int  # one combined frame's header (+ tag)
    # what the slices and combined shards are, for the plan's reason: "sign" (1-bit slices, combined shards
    # in bits per element), "sparse" (sparse slices, combined shards re-sparsified, or float32 when exact) or
    # "dense" (float32 slices and shards)
    kind: str = "sign"
    exact: bool = False

    def slices(self, n: int) -> float:
        return self.slices_body + n * self.slice_header

    def combined(self, n: int) -> float:
        return self.combined_body + n * self.combined_header

    @property
    def resparsified(self) -> bool:
        """Whether the owners return the combined shards re-sparsified (they apply part of what the all-gather
        would; :data:`RESPARSIFIED_ROUNDS`)."""
        return self.kind == "sparse" and not self.exact


@dataclass(frozen=True)
class ExchangeCost:
    name: str
    seconds: float
    sent_bytes: float  # per region per round
    received_bytes: float  # per region per round
    combined_payloads: int  # payloads (or slices of the whole model's size) each region combines


@dataclass(frozen=True)
class ExchangeChoice:
    """The exchange a round uses, its cost, why, and what the others would cost."""

    name: str
    cost: ExchangeCost
    reason: str
    candidates: dict[str, ExchangeCost] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.cost.seconds

    def to_json(self) -> dict:
        return {"exchange": self.name, "reason": self.reason,
                "candidates": {k: {"seconds": c.seconds, "sent_bytes": c.sent_bytes,
                                   "received_bytes": c.received_bytes, "combined_payloads": c.combined_payloads}
                               for k, c in self.candidates.items()}}  # fmt: skip


def exchange_costs(wan: WanModel, collective: str, payload_bytes: float, sharded: ShardedSizes | None = None,
                   keyed: bool = False) -> dict[str, ExchangeCost]:  # fmt: skip
    """Every candidate exchange's cost on ``wan`` for one round (``collective``: the method's, ``all_reduce``
    for dense payloads, ``all_gather`` for sign payloads; ``sharded`` sizes add the sharded exchange).
    ``keyed``: a run key signs the payloads, so dense ones are gathered or sharded, never summed unchecked."""
    n = wan.n
    if collective == "all_reduce" and not keyed:
        b = WanModel.allreduce_bytes_per_worker(payload_bytes, n)
        return {"all_reduce": ExchangeCost("all_reduce", wan.allreduce_s(payload_bytes), b, b, 1)}
    if collective not in ("all_gather", "all_reduce"):
        raise ValueError(f"collective {collective!r}: expected all_reduce or all_gather")
    b = WanModel.allgather_bytes_per_worker(payload_bytes, n)
    out = {"all_gather": ExchangeCost("all_gather", wan.allgather_s(payload_bytes), b, b, n)}
    if sharded is not None and n >= 2:
        s, c = sharded.slices(n), sharded.combined(n)
        b = WanModel.sharded_bytes_per_worker(s, c, n)
        out["sharded"] = ExchangeCost("sharded", wan.sharded_s(s, c), b, b, 1)
    return out


def choose_exchange(wan: WanModel, collective: str, payload_bytes: float, sharded: ShardedSizes | None = None,
                    forced: str = "auto", overlap: bool = False, bits: int | None = None,
                    keyed: bool = False, hidden_s: float = 0.0) -> ExchangeChoice:  # fmt: skip
    """The exchange of one round: ``forced`` (``all_gather`` or ``sharded``) when a sign or sparse method's
    scenario names one, else the cheapest candidate by modeled time (of two within :data:`SAME_TIME`, the one
    with fewer bytes). ``overlap``: each exchange is timed by what the next round's compute does not hide,
    ``hidden_s`` the all-gather round's compute (a re-sparsified sharded round's is 1/:data:`RESPARSIFIED_ROUNDS`
    of it). Dense payloads (``all_reduce``) are all-reduced unless ``keyed``: then they take the all-gather of
    whole signed payloads or the sharded exchange, as sign payloads do."""
    costs = exchange_costs(wan, collective, payload_bytes, sharded, keyed)
    n = wan.n
    if collective == "all_reduce" and not keyed:
        return ExchangeChoice("all_reduce", costs["all_reduce"], "dense payloads are all-reduced (no run key: the "
                              "sum needs no per-sender check)", costs)  # fmt: skip
    signed = collective == "all_reduce"  # dense and keyed: why the all-reduce is out, before the choice
    if forced not in ("auto", "all_gather", "sharded"):
        raise ValueError(f"exchange {forced!r}: expected auto, all_gather or sharded")
    if forced != "auto":
        if forced not in costs:
            raise ValueError(f"exchange {forced!r} is not available here (one region)")
        name, why = forced, "geomesh.exchange forces it"
    elif len(costs) == 1:
        name = "all_gather"
        why = ("a single region exchanges nothing" if n < 2
               else "these payloads are all-gathered (they are neither sign, sparse sign nor dense payloads: no "
                    "sharding)")  # fmt: skip
    else:
        ag, sh = costs["all_gather"], costs["sharded"]
        rounds = RESPARSIFIED_ROUNDS if sharded is not None and sharded.resparsified else 1.0
        under = hidden_s if overlap else 0.0  # the compute that hides an overlapped all-gather
        hide = {"all_gather": under, "sharded": under / rounds}
        timed = {"all_gather": max(0.0, ag.seconds - hide["all_gather"]),
                 "sharded": rounds * max(0.0, sh.seconds - hide["sharded"])}
        if abs(timed["all_gather"] - timed["sharded"]) <= SAME_TIME * max(timed.values()):
            name = "sharded" if sh.received_bytes < ag.received_bytes else "all_gather"
            other = "sharded" if name == "all_gather" else "all_gather"
            why = (f"as fast as the {EXCHANGE_NAMES[other]} by the WAN model at {n} regions ({timed[name]:.2f} s "
                   f"against {timed[other]:.2f} s, within {SAME_TIME:.0%}), with fewer bytes")  # fmt: skip
        else:
            name = min(timed, key=lambda k: (timed[k], k != "all_gather"))
            other = "sharded" if name == "all_gather" else "all_gather"
            why = (f"cheapest by the WAN model at {n} regions: {timed[name]:.2f} s against the "
                   f"{EXCHANGE_NAMES[other]}'s {timed[other]:.2f} s")  # fmt: skip
        if rounds != 1.0:
            why += (f" (the sharded exchange timed at {rounds:g} exchanges of {sh.seconds:.2f} s: its owners "
                    f"re-sparsify, so a round applies one payload's share of the update where the all-gather "
                    f"applies the union of {n} payloads, and its rounds carry 1/{rounds:g} of the "
                    f"sequences)")  # fmt: skip
        if overlap:
            why += (f" (overlapped: each exchange counted by what the next round's compute does not hide, "
                    f"{hide['all_gather']:.2f} s of compute under the all-gather, {hide['sharded']:.2f} s under "
                    f"the sharded exchange; on the wire {ag.seconds:.2f} s and {sh.seconds:.2f} s)")  # fmt: skip
    cost = costs[name]
    what = _pieces(sharded, bits)
    if name == "sharded":
        why += (f"; each region receives {_mb(cost.received_bytes)} ({what}) instead of "
                f"{_mb(costs['all_gather'].received_bytes)} ({n - 1} payloads), and combines one shard instead of "
                f"{n} payloads")  # fmt: skip
    elif "sharded" in costs:
        why += (f"; each region receives {_mb(cost.received_bytes)} ({n - 1} payloads) against the sharded "
                f"exchange's {_mb(costs['sharded'].received_bytes)} ({what})")  # fmt: skip
    if signed:
        why = ("a run key signs every dense payload, so the unsigned all-reduce is out (a sum in flight cannot be "
               "checked per sender); " + why)  # fmt: skip
        if name == "sharded":
            ring = WanModel.allreduce_bytes_per_worker(payload_bytes, n)
            why += f" (a ring all-reduce would send {_mb(ring)} unchecked)"
    return ExchangeChoice(name, cost, why, costs)


def _pieces(sizes: ShardedSizes | None, bits: int | None) -> str:
    """What the sharded exchange moves, in words."""
    if sizes is not None and sizes.kind == "sparse":
        back = "in float32 (exact)" if sizes.exact else "re-sparsified by its owner, with the owner's error feedback"
        return f"the sparse slices of its shard, then every shard combined {back}"
    if sizes is not None and sizes.kind == "dense":
        return "the signed float32 slices of its shard, then every shard combined in float32 (exact)"
    return f"the 1-bit slices of its shard, then every shard combined in {bits or '?'} bits"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.2f} GB"


def sharded_sizes(codec, bits: int, params: int, keyed: bool | None = None) -> ShardedSizes | None:
    """The sharded exchange's bytes for a timing model of ``params`` parameters, measured on ``codec`` (the
    run's sign, sparse or dense codec on the model that trains: its bytes per parameter, headers and tags;
    ``keyed``: count a tag per piece whether or not ``codec`` holds the key); None when its payloads cannot
    be sharded (not a token-weighted sign codec, a sparse one, nor a dense one)."""
    from ..codec import DenseCodec, SparseSignCodec
    from ..codec.sharded import COMBINED_HEADER_NBYTES
    from ..codec.sharded_sparse import shardable, sharded_exchange

    if not shardable(codec):
        return None
    numel = codec.manifest.numel
    keyed = codec.key is not None if keyed is None else keyed
    tag = 32 if keyed else 0
    if isinstance(codec, DenseCodec):  # slices: the payload's values cut in N; shards back in float32
        header = 48 + tag
        return ShardedSizes(slices_body=codec._body_len / numel * params, slice_header=header,
                            combined_body=4.0 * params, combined_header=COMBINED_HEADER_NBYTES + tag,
                            kind="dense", exact=True)  # fmt: skip
    whole = sharded_exchange(codec, 1, bits)
    header = 48 + tag  # a slice is a payload of its shard: the payload header (+ tag) each
    sparse = isinstance(codec, SparseSignCodec)
    if sparse and whole.resparsify:  # a combined shard is a payload of the shard, as a slice is
        combined_body, combined_header = whole.combined_nbytes(0) - header, header
    else:
        combined_body, combined_header = whole._body_len(0), COMBINED_HEADER_NBYTES + tag
    return ShardedSizes(slices_body=(codec.payload_nbytes() - header) / numel * params, slice_header=header,
                        combined_body=combined_body / numel * params, combined_header=combined_header,
                        kind="sparse" if sparse else "sign", exact=sparse and not whole.resparsify)  # fmt: skip


def scenario_keyed(scenario, codec=None) -> bool:
    """Whether a run of ``scenario`` signs its payloads: ``codec`` holds the run key, or the scenario names
    one (``reliability.hmac_key_env`` / ``hmac_key_file``; ``geomesh plan`` reads no secret)."""
    if codec is not None and getattr(codec, "key", None) is not None:
        return True
    rel = getattr(scenario, "reliability", None)
    return rel is not None and (rel.hmac_key_env is not None or rel.hmac_key_file is not None)


def _sizes(scenario, collective: str, codec, keyed: bool) -> ShardedSizes | None:
    if collective == "all_reduce" and not keyed:
        return None
    return sharded_sizes(codec, scenario.geomesh.shard_bits, scenario.timing().params,
                         keyed=keyed if collective == "all_reduce" else None)  # fmt: skip


def scenario_exchange(scenario, wan: WanModel, collective: str, payload_bytes: float, codec=None,
                      overlap: bool = False, hidden_s: float = 0.0) -> ExchangeChoice:  # fmt: skip
    """The exchange of a method on ``scenario``'s cluster (or the live part of it, ``wan``): the scenario's
    ``geomesh.exchange`` and ``geomesh.shard_bits``, sizes measured on ``codec`` at the timing model's size.
    Dense payloads with a run key (:func:`scenario_keyed`) cannot be all-reduced: gathered or sharded.
    ``overlap``, ``hidden_s``: :func:`choose_exchange` (the method's ``overlap_hidden_s``)."""
    g = scenario.geomesh
    keyed = collective == "all_reduce" and scenario_keyed(scenario, codec)
    sizes = _sizes(scenario, collective, codec, keyed) if codec is not None else None
    forced = g.exchange if sizes is not None and wan.n >= 2 else "auto"
    return choose_exchange(wan, collective, payload_bytes, sizes, forced=forced, overlap=overlap, bits=g.shard_bits,
                           keyed=keyed, hidden_s=hidden_s)  # fmt: skip


def with_exchange(scenario, name: str):
    """``scenario`` with ``geomesh.exchange`` set to the exchange a runtime chose (``name``), so that a method
    plans its round for the exchange it really uses (a re-sparsified sharded exchange's rounds are shorter:
    ``CompressedMethod.constraints``)."""
    if name not in ("all_gather", "sharded") or scenario.geomesh.exchange == name:
        return scenario
    return replace(scenario, geomesh=replace(scenario.geomesh, exchange=name))


def scenario_exchange_seconds(scenario, wan: WanModel, collective: str, payload_bytes: float, name: str,
                              codec=None) -> float:  # fmt: skip
    """The time on ``wan`` of the exchange ``name`` that :func:`scenario_exchange` chose (on another WAN: the
    plan chooses on the WAN it assumes, the cluster's own WAN times it)."""
    keyed = collective == "all_reduce" and scenario_keyed(scenario, codec)
    sizes = _sizes(scenario, collective, codec, keyed) if name == "sharded" else None
    return exchange_costs(wan, collective, payload_bytes, sizes, keyed)[name].seconds
