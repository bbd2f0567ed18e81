"""The Monitor: one rank's metrics, recorded from a normal training loop.

    monitor = Monitor(MonitorConfig(base_port=9400))   # identity from torchrun's env
    monitor.start()                                    # serves /metrics on 9400 + local_rank
    monitor.watch(model, optimizer)                    # LRs, per-module norms, update ratios
    monitor.attach_comm_hook(ddp_model)                # all-reduce time
    for batch in monitor.data(loader):                 # data-loader wait
        with monitor.step(samples=len(batch)) as step:  # step time, counters
            loss = model(batch).loss
            loss.backward()
            norm = monitor.clip_grad_norm_(model.parameters(), 1.0)  # torch's, sharing its norms
            if step.record(loss=loss, grad_norm=norm):  # False: guard says skip this update
                optimizer.step()
            optimizer.zero_grad()

Cost: no host-device sync per step. Device scalars are kept detached and read
in one batched transfer every `resolve_every_n_steps` steps (CPU tensors are
read at once, which costs nothing). Resource probes run at scrape time, in
the HTTP thread. The only optional sync is `skip_nonfinite=True`, which must
know the answer before the optimizer step.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from rankscope import contract
from rankscope._log import LogOnce
from rankscope.collectives import CollectiveView, enable_collective_view
from rankscope.comm import CommTimer, events_seconds, interval_union
from rankscope.config import MonitorConfig
from rankscope.contract import PREFIX, MetricSpec
from rankscope.deferred import DeferredValues, plain_tensor
from rankscope.exits import ExitNote
from rankscope.flops import FlopCounter, device_peak_flops
from rankscope.goodput import PHASE_BUCKETS, GoodputCollector, GoodputFlusher, GoodputLedger, process_start_time
from rankscope.guards import LossSpikeDetector, agree_on_skip, nonfinite_flag, overflow_flag
from rankscope.identity import RankIdentity
from rankscope.instruments import BeforeRender, Instruments, observe_all
from rankscope.modules import ModuleStats
from rankscope.probes import Probe, ProbeCollector, default_probes
from rankscope.progress import PHASE_INDEX, CollectivesCollector, ProgressTracker
from rankscope.serving.exposition import Publication, state_changed
from rankscope.serving.metrics_endpoint import MetricsServer, serve_metrics
from rankscope.serving.webconfig import web_config_for
from rankscope.step_memory import StepPeakMemory

__all__ = ["Monitor", "StepContext"]

logger = logging.getLogger("rankscope")

Number = float | int
Value = torch.Tensor | Number


def _default_device(identity: RankIdentity) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", identity.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class StepContext:
    """Handed out by `Monitor.step()`; records what the step computed."""

    def __init__(self, monitor: Monitor, index: int) -> None:
        self._monitor = monitor
        self.index = index
        """The global step this step completes (1-based)."""
        self.skipped = False
        """True when the non-finite guard told the loop to skip the update."""

    def record(self, loss: Value | None = None, grad_norm: Value | None = None) -> bool:
        """Record loss and total gradient norm (pass what `clip_grad_norm_` returned:
        the norm before clipping). Returns whether to apply the optimizer update:
        False only when `skip_nonfinite` is on and a value was NaN/inf on any rank.

        May also be called after the block closed, when the values arrive later
        (e.g. from a framework's logs); they then describe that earlier step."""
        return self._monitor._record_step_values(self, loss, grad_norm)


class Monitor:
    """Per-rank metrics for a training loop. See the module docstring for use."""

    def __init__(
        self,
        config: MonitorConfig | None = None,
        identity: RankIdentity | None = None,
        *,
        device: torch.device | str | None = None,
        registry: CollectorRegistry | None = None,
        probes: Iterable[Probe] | None = None,
        extra_metrics: Iterable[MetricSpec] = (),
    ) -> None:
        """`extra_metrics`: metrics of the loop's own (`MetricSpec`s, checked against Prometheus's
        conventions when declared), recorded with `set`/`inc`/`observe` by their full name, exposed
        beside the contract's with the same identity labels."""
        self.config = config or MonitorConfig()
        self.identity = identity or RankIdentity.from_env()
        self.device = torch.device(device) if device is not None else _default_device(self.identity)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.instruments = Instruments(self.registry, self.identity, extra=extra_metrics)
        self.global_step = 0
        self._deferred = DeferredValues()
        self._publication = Publication()  # a step's end is published through it; the page reads through it
        self._backend_known = False  # run_info's backend: read again at each render until a process group exists
        self.registry.register(BeforeRender(self._refresh_run_info))
        self._children_of: dict[tuple, list[Any]] = {}  # set_each's children, per call shape
        self._spikes = LossSpikeDetector(self.config.spike_window, self.config.spike_ratio, self.config.spike_patience)
        self._comm = CommTimer()
        self._pending_comm: list[tuple[float, float, list[Any]]] = []
        self._modules: ModuleStats | None = None
        self._optimizer: Any | None = None
        self._iteration_start: float | None = None
        self._wait_before = 0.0  # data wait reported before the step's block: added to its duration
        self._wait_inside = 0.0  # data wait reported inside the block: already part of its duration
        self._in_step = False
        self._reports_data_wait = False  # a loop that never reports data wait gets no data-wait series
        self._scaler: Any | None = None
        self._step_memory = StepPeakMemory(self.device) if self.config.step_peak_memory else None
        self._server: MetricsServer | None = None
        self._log = LogOnce()
        self._metric = {short: self.instruments.child(PREFIX + short) for short in _UNLABELLED}
        chosen = list(probes) if probes is not None else default_probes(self.config.probes, self.device)
        # Counters exist at 0 from the first scrape, so increase()/rate() see the first event.
        for probe in chosen:
            self.instruments.child(PREFIX + "monitor_errors_total", probe=probe.name)
        self.registry.register(ProbeCollector(chosen, self.identity.labels(), self.record_error))
        # What this rank is doing and every collective it takes part in, served by the metrics thread.
        self.progress = ProgressTracker()
        self.collectives = self._start_collectives()
        progress = CollectivesCollector(self.progress, self.collectives, self.identity.labels())
        progress._on_error = lambda exc: self._fail("collectives", exc)
        self.registry.register(progress)
        self._set_run_info()
        self.finished = False  # finish() was called: the loop has left
        self.goodput: GoodputLedger | None = None
        self._goodput_flusher: GoodputFlusher | None = None
        if self.config.goodput and self.identity.rank == 0:  # the job's accounting, kept once
            self._start_goodput()
        # Every rank's note of how its process ends, in the run's state directory (rankscope.exits).
        self._exit_note = (
            ExitNote(self.config.goodput_dir, self.identity.rank, self.identity.run_id).begin()
            if self.config.goodput_dir
            else None
        )
        if self._exit_note is not None and self._exit_note.found_at is not None:
            self._lazy("vanished", "previous_process_vanished_timestamp_seconds").set(self._exit_note.found_at)
        self._flops = FlopCounter(self.config.flops_per_step, self.config.count_flops)
        peak = self.config.peak_flops or device_peak_flops(self.device, self.config.compute_dtype)
        if peak:
            self._metric["peak_flops_per_second"] = self.instruments.child(PREFIX + "peak_flops_per_second")
            self._metric["peak_flops_per_second"].set(peak)

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> MetricsServer:
        """Serve /metrics on base_port + local_rank (idempotent)."""
        if self._server is None:
            self._set_run_info()
            port = 0 if self.config.base_port == 0 else self.config.base_port + self.identity.local_rank
            who = f"rank {self.identity.rank} (local_rank {self.identity.local_rank}): "
            self._server = serve_metrics(
                self.registry,
                self.config.host,
                port,
                self.config.port_fallback,
                who,
                page_cache_seconds=self.config.page_cache_seconds,
                web=web_config_for("metrics", self.config.web_config_file),
                consistent=self._publication,
            )
            logger.info("rankscope: rank %d metrics at %s", self.identity.rank, self._server.url)
        return self._server

    @property
    def port(self) -> int | None:
        return self._server.port if self._server else None

    def finish(self) -> None:
        """Mark the run as finished cleanly; call after the last step, and keep serving for at least
        one scrape interval so Prometheus sees it (the rank-down alert then ignores this rank)."""
        self.finished = True  # a SIGTERM from now on finds the loop gone, not hung (control.stop_deadline)
        if self._exit_note is not None:
            self._exit_note.end("finished")
        self._metric["run_finished"].set(1)
        self.flush()
        if self.goodput is not None:
            self.goodput.finish()  # the linger and teardown that follow are not training
            self.goodput.flush()
        state_changed()  # the next scrape shows the end, whatever the page cache holds

    def close(self) -> None:
        """Resolve what is pending, detach hooks and stop serving."""
        if self._exit_note is not None:
            self._exit_note.end("closed")
        self.flush()
        if self._modules is not None:
            self._modules.close()
        if self.collectives is not None:
            self.collectives.close()  # the process groups outlive the monitor: take our hooks off them
        if self._goodput_flusher is not None:
            self._goodput_flusher.close()
            self._goodput_flusher = None
        if self._server is not None:
            self._server.close()
            self._server = None

    # --- wiring to the model -----------------------------------------------------

    def watch(self, model: torch.nn.Module, optimizer: Any | None = None, scaler: Any | None = None) -> None:
        """Learning rates from `optimizer`; per-module grad norms and update ratios
        (groups = the model's top-level children) every `module_stats_every_n_steps`.

        `scaler`: the loop's `torch.amp.GradScaler`, if any. Its loss scale is recorded, and a step
        whose loss is finite but whose (unscaled) gradient norm is not is an overflow that dynamic
        loss scaling expects (the scaler skips that update and lowers its scale): it is counted in
        `loss_scale_overflows_total`, not as a non-finite step, and the guard leaves it to the scaler."""
        self._optimizer = optimizer
        self._scaler = scaler if scaler is not None and _scaler_enabled(scaler) else None
        if scaler is not None and self._scaler is None:  # e.g. fp16 requested where the scaler cannot run
            self._log.warning(
                "disabled_scaler",
                "rankscope: the GradScaler is disabled (is_enabled() is False): the loss is not scaled and no loss "
                "scale or overflows are recorded",
            )
        if self._scaler is not None:  # exposed from here on, at 0 until the first overflow (for increase())
            self._metric["loss_scale_overflows_total"] = self.instruments.child(PREFIX + "loss_scale_overflows_total")
        if self._modules is not None:
            self._modules.close()
            self._modules = None
        try:
            self._modules = ModuleStats(
                model,
                optimizer,
                self.config.module_stats_every_n_steps,
                self.config.max_module_groups,
                self._module_sink,
                on_error=self._module_stats_failed,
            )
        except Exception as exc:  # a parameter type the statistics cannot measure: they stay off, counted
            self._fail("module_stats", exc)

    def attach_comm_hook(self, ddp_model: Any) -> None:
        """Time the gradient all-reduce of a DistributedDataParallel model.

        Registers a comm hook that runs DDP's default all-reduce unchanged. Call
        before the first backward (DDP allows one comm hook per model).
        """
        register = getattr(ddp_model, "register_comm_hook", None)
        if register is None:  # FSDP2, tensor parallel, a plain module: no DDP reducer to hook; training goes on
            self._fail(
                "comm_hook",
                TypeError(
                    f"attach_comm_hook: {type(ddp_model).__name__} is not DistributedDataParallel (no comm hook"
                    " to register); nothing attached"
                ),
            )
            return
        register(None, self._comm.hook)
        self._comm.attached = True

    def watch_mesh(self, mesh: Any) -> None:
        """Label collectives by the DeviceMesh dimension they run over (`dim`: data, tensor, pipeline,
        context, other; from the mesh's dim names, e.g. dp_shard -> data, tp -> tensor). Without it, the
        default group's collectives are `data` and other groups' `other`."""
        if self.collectives is not None:
            self.collectives.watch_mesh(mesh)

    def collective_in_flight(self) -> dict[str, Any] | None:
        """The oldest collective this rank has started and not finished, read now (kind, dim, group, since
        in Unix seconds), or None. Stacks carry it: a wait inside C++ (DDP's all-reduce under backward)
        shows in a Python stack only as the call that entered it."""
        view = self.collectives
        if view is None or not view.enabled:
            return None
        view.read()
        flight = view.in_flight
        if flight is None:
            return None
        return {"kind": flight.kind, "dim": flight.dim, "group": flight.group, "since": flight.started}

    # --- the loop ----------------------------------------------------------------

    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Iterate `iterable`, timing how long each `next()` blocks."""
        iterator = iter(iterable)
        while True:
            started = time.perf_counter()
            self.progress.set(_DATA_WAIT)
            try:
                item = next(iterator)
            except StopIteration:
                return
            self._iteration_start = started
            self.record_data_wait(time.perf_counter() - started)
            yield item

    def record_data_wait(self, seconds: float) -> None:
        """For loops that fetch batches themselves: time blocked on a batch.

        Before `step()`, the wait is added to that step's duration; inside the step's block (a
        prefetch of the next batch, the micro-batches of gradient accumulation) it is already part
        of the block's wall time and is not added again. Either way it is this step's data wait
        (summed over calls), which compute time excludes."""
        self._reports_data_wait = True
        if self._in_step:
            self._wait_inside += seconds
        else:
            self._wait_before += seconds

    @contextmanager
    def step(self, samples: int = 0, tokens: int = 0, max_seq_len: Value | None = None) -> Iterator[StepContext]:
        """One training step. The step's duration runs from the start of this
        iteration's data fetch (if `data()` is used) to the end of the block.

        `max_seq_len`: the longest sequence the step computes on, in tokens (the padded length where
        the loop pads each batch to its longest: that is what activation memory follows), as a host
        number or a tensor (resolved in the batched transfer, no sync); it becomes
        `rankscope_sequence_length_max_tokens`. With `step_peak_memory` on, on CUDA, the step's peak
        allocated memory is recorded too."""
        # With data(), the iteration began when the fetch began; otherwise the wait
        # reported through record_data_wait() is added to the block's duration.
        fetched_by_data = self._iteration_start is not None
        started = self._iteration_start if self._iteration_start is not None else time.perf_counter()
        context = StepContext(self, self.global_step + 1)
        if self.goodput is not None and not self._goodput_training:
            self._goodput_begin(started, context.index - 1)
        if self._flops.measuring:
            self._flops_call(self._flops.begin)
        if self._modules is not None:
            self._modules.begin_step(context.index)
        if self._step_memory is not None:
            self._step_memory_call(lambda memory: memory.begin())
        self._in_step = True
        self._deferred.holding = True  # what the step records shows with its global_step, at its end
        self.progress.begin_step()
        try:
            yield context
        except BaseException:
            self._deferred.release()  # a step that failed: what it recorded shows now, nothing lost
            raise
        finally:
            self._in_step = False
            self.progress.set(_STEP_BOUNDARY)  # until the next fetch: the loop's own end-of-step work, control
            if self._flops.measuring:
                self._flops_call(self._flops.end)
        # Only a block that completed counts as a step; an exception propagates untouched.
        ended = time.perf_counter()
        seconds = ended - started + (0.0 if fetched_by_data else self._wait_before)
        self._finish_step(context, ended, seconds, samples, tokens, max_seq_len)
        if self._deferred.holding:  # the step's end failed before publishing it
            self._deferred.release()

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_`, bit for bit, sharing its work with the module grad norms.

        Same arguments and result: the total norm and the clipped gradients are exactly torch's. On
        steps where module grad norms are due and `parameters` are the watched model's, each
        gradient's norm is computed once for both; on other due steps the module norms are taken
        before torch clips, so they are pre-clip either way."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self._modules is not None and norm_type == 2.0 and not error_if_nonfinite:
            try:
                # Returns torch's total once it has clipped, even if its statistics then fail: a gradient
                # is clipped once. An exception from here means nothing was clipped yet.
                total = self._modules.clip_grad_norm_(params, max_norm, foreach)
            except Exception as exc:  # monitoring must never break the step: clip the plain way
                self._module_stats_failed(exc)
                total = None
            if total is not None:
                return total
        if self._modules is not None:
            try:
                self._modules.record_grad_norms()  # before clipping; nothing if not due
            except Exception as exc:
                self._module_stats_failed(exc)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    def set_step(self, step: int) -> None:
        """Continue counting from `step` (after resuming from a checkpoint)."""
        ledger = self.goodput
        if ledger is not None and step < max(self.global_step, ledger.step):
            ledger.restore(step)  # went back (a resume or a rollback): the steps trained since are lost
        self.global_step = step
        self._metric["global_step"].set(step)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time spent in a phase that is not training: `checkpoint` (a blocking save), `validation`,
        `paused`. The goodput accounts it in its own bucket (docs/goodput.md). Around a checkpoint save,
        the step saved is marked too, so that a later resume or rollback to it loses only what came after."""
        known = getattr(contract, "PHASES", PHASE_BUCKETS)
        if name not in known and name not in PHASE_BUCKETS:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(known)}")
        ledger = self.goodput if name in PHASE_BUCKETS else None  # other phases are training time
        if ledger is not None:
            ledger.enter(name)
        saved = False
        try:
            with self.progress.holding(name):  # rankscope_phase shows it, even while the block hangs
                yield
            saved = name == "checkpoint"
        finally:
            if ledger is not None:
                ledger.leave(self.global_step if saved else None)

    def record_loss(self, value: Value, split: str = "val") -> None:
        """Record a loss outside the training step (e.g. validation)."""
        self.set("loss", value, split=split)

    def set(self, name: str, value: Value, **labels: str) -> None:
        """Set a gauge (a contract metric by short or full name, or an extra metric by its name); tensors are
        resolved lazily."""
        child = self.instruments.child(self._full(name), **labels)
        self._deferred.add(value, lambda values: child.set(values[-1]))

    def set_each(
        self, name: str, values: torch.Tensor | Sequence[Number], label: str, keys: Sequence[str], **labels: str
    ) -> None:
        """Set one gauge child per key: the child with `label=keys[i]` gets `values[i]`.

        A tensor is resolved as one value (one entry in the batched transfer), cheaper than a
        `set()` per element."""
        if isinstance(values, torch.Tensor) and values.dim() != 1:
            raise ValueError(f"set_each({name!r}) takes one value per key, got a tensor of shape {tuple(values.shape)}")
        cache_key = (name, label, tuple(keys), tuple(labels.items()))
        children = self._children_of.get(cache_key)
        if children is None:
            children = [self.instruments.child(self._full(name), **labels, **{label: key}) for key in keys]
            self._children_of[cache_key] = children
        if len(values) != len(children):
            raise ValueError(f"set_each({name!r}): {len(values)} values for {len(keys)} {label} keys")

        def _set(resolved: list[float]) -> None:
            for child, number in zip(children, resolved, strict=True):
                child.set(number)

        if isinstance(values, torch.Tensor):
            self._deferred.add(values, _set)
        else:
            _set([float(v) for v in values])

    def inc(self, name: str, amount: Value = 1, **labels: str) -> None:
        """Increase a counter from the contract."""
        child = self.instruments.child(self._full(name), **labels)
        self._deferred.add(amount, lambda values: child.inc(sum(values)))

    def observe(self, name: str, value: Value, **labels: str) -> None:
        """Observe into a histogram; a tensor contributes every element."""
        child = self.instruments.child(self._full(name), **labels)
        self._deferred.add(value, lambda values: observe_all(child, values))

    def flush(self) -> None:
        """Turn pending device values into numbers now (one transfer per device)."""
        self._deferred.flush()
        self._resolve_comm_events()

    def _full(self, name: str) -> str:
        """A contract metric's full name from its short one; an extra metric's name as it is."""
        return name if name.startswith(PREFIX) or name in self.instruments else PREFIX + name

    def record_error(self, probe: str) -> None:
        """Count a failure inside monitoring (thread-safe)."""
        self.instruments.child(PREFIX + "monitor_errors_total", probe=probe).inc()

    # --- internals -----------------------------------------------------------------

    def _record_step_values(self, context: StepContext, loss: Value | None, grad_norm: Value | None) -> bool:
        loss, grad_norm = self._readable(loss), self._readable(grad_norm)
        if self._modules is not None:
            try:
                self._modules.record_grad_norms()
            except Exception as exc:  # monitoring must never break the step
                self._module_stats_failed(exc)
        flag: torch.Tensor | bool = False
        try:
            if loss is not None:
                self._deferred.add(loss, self._on_loss)
            if grad_norm is not None:
                self._deferred.add(grad_norm, self._on_grad_norm)
            if self._scaler is not None:
                # Dynamic loss scaling: an overflowing gradient with a finite loss is the scaler's business
                # (it skips the update and backs off); only a non-finite loss is a non-finite step.
                flag = nonfinite_flag(loss)
                self._deferred.add(overflow_flag(loss, grad_norm), self._on_overflow)
            else:
                flag = nonfinite_flag(loss, grad_norm)
        except Exception as exc:  # monitoring must never break the step
            self._fail("record", exc)
        if not self.config.skip_nonfinite:
            self._deferred.add(flag, self._on_nonfinite)
            return True
        # The one deliberate sync: the loop needs the answer before optimizer.step().
        skip = agree_on_skip(flag)
        self._on_nonfinite([float(skip)])
        if skip:
            context.skipped = True
            self._metric["skipped_steps_total"].inc()
        return not skip

    def _finish_step(
        self,
        context: StepContext,
        ended: float,
        seconds: float,
        samples: int,
        tokens: int,
        max_seq_len: Value | None,
    ) -> None:
        try:
            data_wait = self._wait_before + self._wait_inside
            self._wait_before = self._wait_inside = 0.0
            self._iteration_start = None
            self.global_step = context.index
            now = time.time()
            if self.goodput is not None:
                self.goodput.on_step(context.index, now, seconds)
            if max_seq_len is not None:
                self.set("sequence_length_max_tokens", max_seq_len)
            peak = self._step_memory_call(lambda memory: memory.end()) if self._step_memory is not None else None
            if peak is not None:
                self.instruments.child(PREFIX + "step_peak_device_memory_bytes").set(peak)
            self._publish_step(context.index, now, seconds, data_wait, samples, tokens)
            comm_seconds, events = self._comm.take_step()
            if self.collectives is not None:
                intervals = self.collectives.take_step(ended - seconds)
                if not self._comm.attached:  # the DDP hook, where attached, is the one source of this histogram
                    comm_seconds = interval_union(intervals)
            if events:
                self._pending_comm.append((seconds, data_wait, events))
            else:
                self._observe_split(seconds, data_wait, comm_seconds)
            self._record_learning_rates()
            due = context.index % self.config.resolve_every_n_steps == 0
            if self._scaler is not None:
                scale = _scale_of(self._scaler)  # after the loop's scaler.update()
                if due or not isinstance(scale, torch.Tensor) or scale.is_cpu:  # a device read waits for a flush
                    self.set("loss_scale", scale)
            if self._deferred and due:
                self.flush()
        except Exception as exc:
            self._fail("step", exc)

    def _publish_step(
        self, index: int, now: float, seconds: float, data_wait: float, samples: int, tokens: int
    ) -> None:
        """The step's number, its counts and times and the values recorded during it, at one moment for a scrape
        (no device value is read: those show at the flush that resolves them). Never waits for a scrape."""
        m = self._metric
        with self._publication:
            m["global_step"].set(index)
            m["step_duration_seconds"].observe(seconds)
            if self._reports_data_wait:
                m["data_wait_seconds"].observe(data_wait)
            m["steps_total"].inc()
            if self._flops.per_step:
                self._model_flops().inc(self._flops.per_step)
            if samples:
                m["samples_total"].inc(samples)
            if tokens:
                m["tokens_total"].inc(tokens)
            m["last_step_timestamp_seconds"].set(now)
            self._deferred.release()

    def _start_goodput(self) -> None:
        config = self.config
        self.goodput = GoodputLedger(
            config.goodput_dir or None,
            process_start=process_start_time(time.time()),
            hang_floor_seconds=config.hang_floor_seconds,
            hang_step_multiple=config.hang_step_multiple,
        )
        self._goodput_training = False
        self.registry.register(GoodputCollector(self.goodput, self.identity.labels()))
        if config.goodput_dir:
            self._goodput_flusher = GoodputFlusher(self.goodput, config.goodput_flush_seconds)

    def _goodput_begin(self, started: float, previous_step: int) -> None:
        """Start-up ends where this incarnation's first step began (`started` on the perf_counter clock)."""
        self._goodput_training = True
        self.goodput.first_step(time.time() - (time.perf_counter() - started), previous_step)  # type: ignore[union-attr]

    def _model_flops(self) -> Any:
        return self._lazy("model_flops_total", "model_flops_total")

    def _flops_call(self, call: Any) -> None:
        """Enter or leave the FLOP counter; a failure is counted and the step goes on uncounted."""
        try:
            call()
        except Exception as exc:  # monitoring must never break the step
            self._flops = FlopCounter(0, False)
            self._fail("flops", exc)

    def _step_memory_call(self, call: Any) -> Any:
        """`call(StepPeakMemory)` if step peaks are measured; a failure is counted and switches them off."""
        if self._step_memory is None:
            return None
        try:
            return call(self._step_memory)
        except Exception as exc:  # monitoring must never break the step
            self._step_memory = None
            self._fail("step_memory", exc)
            return None

    def _start_collectives(self) -> CollectiveView | None:
        """The collective view, on when torch's Flight Recorder records (said once, with why, when not)."""
        if not (dist.is_available() and dist.is_initialized()):
            enable_collective_view()  # early enough: the first process group will record
        view = CollectiveView()
        if not view.enabled:
            logger.warning("rankscope: collective view off (no counts, no phase 'collective'): %s", view.why_off)
            return None
        return view

    def _observe_split(self, step_seconds: float, data_wait: float, comm_seconds: float) -> None:
        if self._comm.attached or (self.collectives is not None and self.collectives.times_steps):
            self._metric["comm_duration_seconds"].observe(comm_seconds)
        self._metric["compute_duration_seconds"].observe(max(0.0, step_seconds - data_wait - comm_seconds))

    def _resolve_comm_events(self) -> None:
        while self._pending_comm:
            step_seconds, data_wait, events = self._pending_comm[0]
            comm_seconds = events_seconds(events)
            if comm_seconds is None:
                return  # not complete yet; the next flush gets it, in order
            self._pending_comm.pop(0)
            self._observe_split(step_seconds, data_wait, comm_seconds)

    def _record_learning_rates(self) -> None:
        if self._optimizer is None:
            return
        for index, group in enumerate(self._optimizer.param_groups):
            lr = group["lr"]
            child = self._lazy(f"learning_rate/{index}", "learning_rate", param_group=str(index))
            if type(lr) is float:  # the common case, set as it is (what set() does with a host number)
                child.set(lr)
            else:
                self._deferred.add(lr, functools.partial(_set_last, child))

    def _on_loss(self, values: list[float]) -> None:
        loss = values[-1]
        self._lazy("train_loss", "loss", split="train").set(loss)
        if self._spikes.update(loss):
            self._metric["loss_spikes_total"].inc()

    def _on_grad_norm(self, values: list[float]) -> None:
        self._lazy("grad_norm", "grad_norm").set(values[-1])

    def _lazy(self, key: str, short: str, **labels: str) -> Any:
        """A child bound on first use (a series appears once it has a value), then a dict lookup per step."""
        child = self._metric.get(key)
        if child is None:
            child = self._metric[key] = self.instruments.child(PREFIX + short, **labels)
        return child

    def _on_nonfinite(self, values: list[float]) -> None:
        if values and values[-1]:
            self._metric["nonfinite_steps_total"].inc()

    def _on_overflow(self, values: list[float]) -> None:
        if values and values[-1]:
            self._metric["loss_scale_overflows_total"].inc()

    def _readable(self, value: Value | None) -> Value | None:
        """A recorded value as a plain tensor (a replicated DTensor's local value, no communication); one
        the monitor cannot read without a collective is dropped, counted and logged once."""
        if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor:
            return value
        try:
            return plain_tensor(value)
        except Exception as exc:
            self._fail("record", exc)
            return None

    def _module_stats_failed(self, exc: BaseException) -> None:
        """Per-module statistics met something they cannot measure: counted, logged once, switched off."""
        if self._modules is not None:
            self._modules.disable()
        self._fail("module_stats", exc)

    def _module_sink(self, metric: str, groups: list[str], values: torch.Tensor) -> None:
        self.set_each(metric, values, "module", groups)

    def _fail(self, probe: str, exc: BaseException) -> None:
        self.record_error(probe)
        self._log.warning(probe, "rankscope: %s failed (training goes on; counted, logged once): %r", probe, exc)

    def _refresh_run_info(self) -> None:
        """A Monitor created before init_process_group (as the collective view wants) learns the group's
        backend at the first render after the group exists (metrics thread: reads torch's group map only)."""
        if self._backend_known or not (dist.is_available() and dist.is_initialized()):
            return
        try:
            self._set_run_info()
        except Exception as exc:  # never into the page: the label stays "none", counted
            self._backend_known = True
            self._fail("run_info", exc)

    def _set_run_info(self) -> None:
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
        self._backend_known = backend != "none"
        self.instruments.child(PREFIX + "run_info").info(
            {
                "world_size": str(self.identity.world_size),
                "node_rank": str(self.identity.node_rank),
                "torch_version": torch.__version__,
                "cuda_version": torch.version.cuda or "none",
                "backend": str(backend),
                "model": self.config.model_name or "unknown",
                "config_hash": self.config.config_hash or "none",
            }
        )


# Metrics without extra labels, bound once so the hot path is a dict lookup.
_UNLABELLED = (
    "step_duration_seconds",
    "data_wait_seconds",
    "comm_duration_seconds",
    "compute_duration_seconds",
    "steps_total",
    "samples_total",
    "tokens_total",
    "global_step",
    "last_step_timestamp_seconds",
    "run_finished",
    "nonfinite_steps_total",
    "skipped_steps_total",
    "loss_spikes_total",
)


def _set_last(child: Any, values: list[float]) -> None:
    child.set(values[-1])


def _scaler_enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def _scale_of(scaler: Any) -> Value:
    """The scaler's current loss scale without a host-device sync where torch allows it (the
    scale tensor joins the batched transfer); `get_scale()` itself reads it to the host."""
    scale_async = getattr(scaler, "_get_scale_async", None)
    scale = scale_async() if callable(scale_async) else None
    return scale if isinstance(scale, torch.Tensor) else float(scaler.get_scale())


_DATA_WAIT = PHASE_INDEX["data_wait"]
_STEP_BOUNDARY = PHASE_INDEX["step_boundary"]
