"""Rollout routing replay (R3): the trainer routes every token to the experts the rollout engine routed it to.

    from megatron_sortedrl.trainer.routing_replay import RoutingReplay, microbatch_routes
    replay = RoutingReplay(model)        # a megatron GPTModel (or this stage of it) built with moe_enable_routing_replay
    routes = microbatch_routes([r0, r1], seq_len=mb.tokens.shape[1], topk=replay.topk)   # r_i: [n_i, L, k]
    replay.set_routes(routes)            # before the micro-batch's forward (log-prob pass and training pass)
    ... forward / backward of the micro-batch ...
    replay.clear()                       # after the step (or to go back to the router's own choice)
    pytest tests/test_routing_replay.py

In the trainer (worker.py) `TrainerReplay` does this for every model the worker runs (policy, KL reference):
the log-prob pass and the training pass set each micro-batch's routes in the schedule's forward step, before
the chunk's forward, from `routes_for_microbatch(mb, {item index: item["routes"]}, topk, moe_layers)`, and
clear them once the schedule has returned (every forward, backward and recompute of the step done).

Samples without routes. A batch is replayed only when every item's routes cover all its input positions; any
other batch (a dense model, capture off, a sample generated before replay was switched on, an engine that
returned none) runs wholly on the routers' own choice, in both passes alike, and the trainer's metrics say
so (`routing_replay/replayed`: 1 or 0). Replaying part of a batch would train its samples under two routings
at once; routes recorded from another model (layers, top-k or experts differ) are refused in one line.

It drives megatron-core 0.16.1's own replay (`transformer/moe/router_replay.py`): every `TopKRouter` built with
`TransformerConfig.moe_enable_routing_replay=True` owns a `RouterReplay` that, when told to replay, takes the
given top-k expert ids instead of the router's top-k and gathers the router's scores at those ids (so the gate
weights stay differentiable and follow the current router; only the choice of experts is fixed). This class
reaches the replays through the model's own modules, not megatron's process-wide instance list (which also
holds a reference model's routers), and maps route columns to routers by the layer number each router carries,
so a pipeline stage takes its own layers' columns.

Token order. `routes` is [tokens, moe_layers, topk] in megatron's router order: the micro-batch's [seq, batch]
flattened sequence-major (token (s, b) is row `s * batch + b`). `microbatch_routes` builds it from per-sample
routes of the model's input positions (prompt + response minus its last token, the positions the trainer
scores: the route of position i is the engine's routing of input token i); padding positions get experts
0..k-1, which only padding tokens see (causal attention, loss mask). With sequence parallelism each TP rank
routes its own slice of the sequence: pass `seq_slice` to `set_routes`.

Recompute. A full-recompute backward runs the routers again inside the autograd engine; megatron's replay
then needs the `REPLAY_BACKWARD` action, which pops the micro-batches' routes in the order they were set (the
order of backward passes in megatron's schedules, 1F1B included). Each replay here picks the action per call:
backward while the autograd engine is running a node (recompute), forward otherwise, so no schedule hook is
needed.

Deliberately left out: the fused router (`moe_router_fusion`, Transformer Engine's top-k kernel) ignores
megatron's replay, so it is refused; sinkhorn routing (no top-k) likewise; capacity-factor token dropping is
applied after the replayed choice, as megatron does; context parallelism (not run by this trainer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


def _in_backward() -> bool:
    """True while the autograd engine executes a backward node (a recompute inside the backward pass)."""
    return torch._C._current_autograd_node() is not None


class RoutingReplay:
    """The replay switches of one model (chunk): set routes for a micro-batch, record the router's own, clear."""

    def __init__(self, model: torch.nn.Module, moe_layer_numbers: Sequence[int] | None = None):
        """`moe_layer_numbers`: megatron's (1-based, global) layer numbers of the model's MoE layers, in route
        column order; default: every layer 1..num_layers (no dense layers between them)."""
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("routing replay: the model has no MoE router")
        cfg = routers[0].config
        if not cfg.moe_enable_routing_replay:
            raise ValueError("routing replay: build the model with TransformerConfig(moe_enable_routing_replay=True)")
        if cfg.moe_router_fusion or routers[0].routing_type == "sinkhorn":
            raise ValueError("routing replay: the fused router and sinkhorn routing bypass megatron's replay; "
                             "build the model with moe_router_fusion=False and top-k routing")
        numbers = list(moe_layer_numbers) if moe_layer_numbers is not None else list(range(1, cfg.num_layers + 1))
        self.routers = sorted(routers, key=lambda r: r.layer_number)
        try:
            self.columns = [numbers.index(r.layer_number) for r in self.routers]
        except ValueError:
            raise ValueError(f"routing replay: router layer numbers {[r.layer_number for r in self.routers]} "
                             f"are not all among the MoE layers {numbers}") from None
        self.num_moe_layers, self.topk, self.num_experts = len(numbers), cfg.moe_router_topk, cfg.num_moe_experts
        for r in self.routers:
            r.router_replay.get_replay_topk = _per_call_action(r.router_replay)

    def set_routes(self, routes: torch.Tensor, seq_slice: slice | None = None, batch: int | None = None) -> None:
        """Replay `routes` ([tokens, moe_layers, topk], any integer dtype) in the next forward of every router of
        this model. `seq_slice` with `batch`: this rank's sequence slice under sequence parallelism."""
        if routes.dim() != 3 or routes.shape[1:] != (self.num_moe_layers, self.topk):
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}; expected "
                             f"[tokens, {self.num_moe_layers}, {self.topk}]")
        if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= self.num_experts):
            raise ValueError(f"routing replay: expert ids outside [0, {self.num_experts})")
        if seq_slice is not None:
            if batch is None:
                raise ValueError("routing replay: seq_slice needs the micro-batch size")
            routes = routes.view(-1, batch, self.num_moe_layers, self.topk)[seq_slice].reshape(-1, self.num_moe_layers,
                                                                                                self.topk)
        idx = _on_device(routes.to(torch.int64), self.routers[0].weight.device)  # megatron gathers scores with them
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r, col in zip(self.routers, self.columns):
            r.router_replay.set_target_indices(idx[:, col].contiguous())
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def record(self) -> None:
        """The next forwards route on their own and keep their choice (`recorded()`)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self) -> torch.Tensor:
        """[tokens, layers of this model, topk] expert ids the routers chose in the last recorded forward."""
        got = [r.router_replay.get_recorded_indices() for r in self.routers]
        if any(g is None for g in got):
            raise RuntimeError("routing replay: nothing recorded (call record() before the forward)")
        return torch.stack(got, dim=1)

    def clear(self) -> None:
        """Back to the routers' own choice; drops every route set or recorded."""
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()


def _on_device(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`idx` on the routers' device, moved once per micro-batch: megatron's `get_replay_topk` moves its target
    indices to the scores' device in every MoE layer of every forward and recompute, a synchronous host-to-device
    copy each from host memory; on the device already, that `.to` is a no-op. On a GPU the copy is made from
    pinned memory without blocking the host (ordered on the current stream before the forward's kernels)."""
    if idx.device == device:
        return idx
    if device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx.to(device)


def _per_call_action(replay):
    """megatron's `get_replay_topk` with the replay direction chosen per call (see the module docstring)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if replay.router_replay_action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            replay.router_replay_action = (RouterReplayAction.REPLAY_BACKWARD if _in_backward()
                                           else RouterReplayAction.REPLAY_FORWARD)
        return RouterReplay.get_replay_topk(replay, scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk


def microbatch_routes(rows: Sequence[torch.Tensor | None], seq_len: int, topk: int,
                      num_moe_layers: int | None = None) -> torch.Tensor:
    """[seq_len * len(rows), L, k] int64 routes of a padded micro-batch in megatron's router order, from one
    [n_i, L, k] tensor per row (n_i <= seq_len: the row's input positions; None: a row without routes, e.g. a
    collective-keeping dummy, routed like padding). Padding positions route to experts 0..k-1."""
    known = [r for r in rows if r is not None]
    layers = num_moe_layers if num_moe_layers is not None else (known[0].shape[1] if known else None)
    if layers is None:
        raise ValueError("microbatch_routes: no row has routes and num_moe_layers is not given")
    out = torch.arange(topk, dtype=torch.int64).expand(seq_len, len(rows), layers, topk).clone()
    for b, r in enumerate(rows):
        if r is None:
            continue
        if r.dim() != 3 or r.shape[0] > seq_len or r.shape[1:] != (layers, topk):
            raise ValueError(f"microbatch_routes: row {b} has routes of shape {tuple(r.shape)}; expected "
                             f"[<= {seq_len}, {layers}, {topk}]")
        out[: r.shape[0], b] = r.to(torch.int64)
    return out.view(seq_len * len(rows), layers, topk)


def route_rows(routes, num_positions: int) -> torch.Tensor | None:
    """One item's routes (`sample.RoutedExperts` or None) as the [num_positions, L, k] int64 rows of
    `microbatch_routes`; None unless they cover every input position (prompt + response - 1): a batch whose
    samples do not all have them is trained without replay, as the trainer-rollout log-probs are."""
    if routes is None or routes.num_rows != num_positions:
        return None
    return torch.from_numpy(routes.array().astype("int64"))


def routes_for_microbatch(mb, routes_by_index: dict, topk: int, num_moe_layers: int) -> torch.Tensor | None:
    """The routes of one `trainer.logprobs.MicroBatch` for `RoutingReplay.set_routes`, from the items' routes keyed
    by their caller index (`item["routes"]`); None when a real row's routes do not cover its input positions
    (the caller then leaves the routers to choose, for the whole batch). Dummy rows (index -1) route like padding."""
    rows = []
    for idx, (_, end) in zip(mb.indices, mb.response_slices):
        if idx < 0:
            rows.append(None)
            continue
        r = route_rows(routes_by_index.get(idx), end)  # `end`: the row's input positions (prompt + response - 1)
        if r is None:
            return None
        rows.append(r)
    return microbatch_routes(rows, mb.tokens.shape[1], topk, num_moe_layers)


def moe_layer_numbers(arch) -> list[int]:
    """megatron's layer numbers (1-based) of an `HFArch`'s MoE layers: the route columns, in order."""
    return [i + 1 for i, sparse in enumerate(arch.moe_layers) if sparse]


class TrainerReplay:
    """worker.py's routing replay: a `RoutingReplay` per model, the batch-wide choice, the routes per micro-batch.

        tr = TrainerReplay(arch, tp_rank=0, tp=1, sequence_parallel=False); tr.attach(model)   # at set-up
        with tr.replaying(model, items) as before_forward:   # None: this batch runs on the routers' own choice
            ... the schedule's forward step calls before_forward(mb) before each micro-batch's forward ...
    """

    def __init__(self, arch, *, tp_rank: int, tp: int, sequence_parallel: bool):
        self.layers, self.topk, self.num_experts = moe_layer_numbers(arch), arch.moe_topk, arch.num_experts
        self.tp_rank, self.tp, self.sp = tp_rank, tp, sequence_parallel and tp > 1
        self.replays: dict[int, RoutingReplay] = {}
        self.replayed = False  # whether the last pass replayed its batch

    @classmethod
    def for_models(cls, arch, enabled: bool, models: Sequence, sequence_parallel: bool) -> TrainerReplay | None:
        """The replay of this rank's `models` (None entries skipped; parallel_state set up), or None when
        `enabled` is off or `arch` is dense (which `algorithm.routing_replay` ignores)."""
        if not (enabled and arch.num_experts):
            return None
        from megatron.core import parallel_state as ps

        out = cls(arch, tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
                  sequence_parallel=sequence_parallel)
        for m in models:
            if m is not None:
                out.attach(m)
        return out

    def attach(self, model: torch.nn.Module) -> None:
        """Takes over the replay switches of `model` (this rank's chunk, built with moe_enable_routing_replay)."""
        self.replays[id(model)] = RoutingReplay(model, self.layers)

    def batch_routes(self, items: list[dict]) -> dict[int, object] | None:
        """{item index: routes} when every item's routes cover its input positions (prompt + response - 1);
        None otherwise (see the module docstring)."""
        out = {}
        for i, item in enumerate(items):
            r = item.get("routes")
            if r is None or r.num_rows != len(item["prompt"]) + len(item["response"]) - 1:
                return None
            if (r.num_layers, r.topk, r.num_experts) != (len(self.layers), self.topk, self.num_experts):
                raise ValueError(f"routing replay: sample {i} has routes over {r.num_layers} MoE layers, top-{r.topk} "
                                 f"of {r.num_experts} experts; the model has {len(self.layers)}, top-{self.topk} of "
                                 f"{self.num_experts} (were they recorded from another model?)")
            out[i] = r
        return out

    @contextlib.contextmanager
    def replaying(self, model: torch.nn.Module, items: list[dict]):
        """Yields the forward-step hook that sets a micro-batch's routes (None: no replay for this batch) and
        clears every route when the block ends, however it ends."""
        replay = self.replays.get(id(model))
        routes = self.batch_routes(items) if replay is not None else None
        self.replayed = routes is not None
        if routes is None:
            yield None
            return

        def before_forward(mb) -> None:
            r = routes_for_microbatch(mb, routes, self.topk, len(self.layers))
            if self.sp:  # each TP rank routes its own slice of the sequence (sequence parallelism)
                n = mb.tokens.shape[1] // self.tp
                replay.set_routes(r, slice(self.tp_rank * n, (self.tp_rank + 1) * n), mb.tokens.shape[0])
            else:
                replay.set_routes(r)

        try:
            yield before_forward
        finally:
            replay.clear()


def replaying(replay: TrainerReplay | None, model, items: list[dict]):
    """`replay.replaying(model, items)`, or a block that yields None when there is no replay."""
    return replay.replaying(model, items) if replay is not None else contextlib.nullcontext()
