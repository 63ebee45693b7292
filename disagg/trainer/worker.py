"""A trainer worker: one Ray actor per trainer bundle.

Holds the HF model (FSDP2-sharded over the trainer workers when there is more
than one), computes the GRPO loss on its share of the batch, steps AdamW, and
after each step takes part in the weight push: every rank materialises full
tensors in the same order (a collective under FSDP), rank 0 broadcasts them in
buckets over the dedicated transport group. The trainer's own process group
(FSDP) and the transport group are distinct; the transport group never becomes
the default group.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch

from disagg import faults
from disagg.cluster import freeze_heap, pin_process
from disagg.config import AlgorithmConfig, TrainerConfig, TransportConfig
from disagg.digests import digest_files, files_under
from disagg.logs import setup_logging
from disagg.samples import TrainSample
from disagg.storage import local_copy, writable_dir
from disagg.trainer.batching import micro_batches
from disagg.trainer.grpo import linear_warmup, mismatch_stats, ppo_clip_loss, token_logprobs
from disagg.trainer.push import TrainerPush
from disagg.trainer.snapshot import Snapshots
from disagg.transport.manifest import ManifestCache

log = logging.getLogger("disagg.trainer")
_RNG_FILE = re.compile(r"rng_rank\d+\.pt")


class TrainerWorker(TrainerPush):
    """Wrapped with ``ray.remote`` by ``TrainerGroup``. Its weight push is ``TrainerPush``'s
    (``trainer/push.py``). The benchmarks' routes are a subclass's (``disagg.bench.actors``)."""

    def __init__(self, rank: int, world_size: int, model_path: str, cfg: TrainerConfig, algo: AlgorithmConfig,
                 transport: TransportConfig, temperature: float, device: str, log_level: str = "INFO",
                 cache_dir: str = "~/.cache/disagg"):
        setup_logging(f"trainer:{rank}", log_level, actor=True)
        faults.arm_from_env()
        self.rank, self.world_size = rank, world_size
        self.model_path = model_path  # a local directory, or a checkpoint at an fsspec URL (copied in setup)
        self.cache_dir = cache_dir  # model.cache_dir: this node's copies of checkpoints at URLs
        self.cfg, self.algo, self.transport_cfg = cfg, algo, transport
        self.temperature = temperature
        # Ray makes the worker's GPU its first visible device; asking torch which one it is would
        # initialise CUDA, here where a GPU shared with engines must see no allocation before setup.
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if device == "cpu":
            torch.set_num_threads(cfg.torch_threads)
            pin_process(cfg.cpu_affinity, f"trainer worker {rank}")
        self.model = None
        self.ref_model = None
        self.opt = None
        self.group = None
        self.sender = None
        self.delta_image = None  # transport.delta on or auto: what every engine of the group holds (DeltaImage)
        self.delta_chooser = None  # transport.delta=auto: delta or dense, sync by sync (DeltaChooser)
        self._manifest_cache = ManifestCache()  # the full-tensor manifest this rank's pushes are planned from (_layout)
        self._push_manifest_cache = ManifestCache()  # this rank's part of it (_push_layout)
        self._params: dict[str, torch.Tensor] | None = None  # named parameters, for the weight sync
        self._flats: list[torch.Tensor] | None = None  # the flat parameter buffers (one rank, fp32 wire)
        self._snapshots = Snapshots()  # transport.overlap_push: what the pushes send
        self._push_stream = None  # CUDA: the stream pushes from snapshots run on
        self._early = None  # an armed push's first buckets, packed as the next train step ends (EarlyPack)
        self._go_waiting = threading.Event()  # an armed push is set up and waits for the driver's word
        self._timeline: deque = deque(maxlen=512)  # (what, version, start, end), time.time()
        self._step_delay_s = cfg.step_delay_s
        self._hold: tuple[threading.Event, float] | None = None  # tests: the next step waits for release_step
        self._coord = None
        self._trace_path: str | None = None  # the next push runs under the profiler (benchmarks: BenchTrainerWorker)
        self._next_kind: str | None = None  # the next push forced dense or a delta (benchmarks: BenchTrainerWorker)

    # ---- setup ---------------------------------------------------------------------
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        from disagg.transport.group import pick_free_port

        return pick_free_port(self.node_ip())

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> dict[str, Any]:
        """Load the model and optimizer; join the trainer group when sharded."""
        from transformers import AutoModelForCausalLM

        self.model_path = str(local_copy(self.model_path, self.cache_dir))
        torch.manual_seed(self.cfg.seed + self.rank)
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=self.transport_cfg.timeout_s))
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        t1 = time.perf_counter()
        model = model.to(self.device)  # on a GPU the first CUDA call: the worker's context starts here
        t2 = time.perf_counter()
        if self.algo.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        if self.world_size > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        elif self.transport_cfg.dtype in (None, "float32"):
            # Parameters in one flat buffer in manifest order: every bucket of a weight
            # sync is a slice of it and goes out without a packing copy.
            from disagg.transport.buckets import flatten_parameters

            self._flats = list(flatten_parameters(model).values())
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=self.cfg.lr, betas=self.cfg.betas,
                                     weight_decay=self.cfg.weight_decay)
        self.sched = linear_warmup(self.opt, self.cfg.warmup_steps)
        n = sum(p.numel() for p in model.parameters())
        log.info("model loaded from %s (%d parameters%s; read %.1f s, to %s %.1f s, the rest %.1f s)", self.model_path,
                 n, f", FSDP2 over {self.world_size} ranks" if self.world_size > 1 else "", t1 - t0, self.device,
                 t2 - t1, time.perf_counter() - t2)
        freeze_heap(f"trainer worker {self.rank}")
        return {"num_parameters": n}

    # ---- training ------------------------------------------------------------------
    def _batch_logprobs(self, model, samples: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of each sample's response and its mask, both [B, T]."""
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        n = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        attn = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            attn[i, : len(x)] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.compute_dtype == "bfloat16"):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        lp = token_logprobs(logits, ids[:, 1:], self.temperature)
        # Response token j of sample i sits at ids[i, P+j]; its log-prob at lp[i, P+j-1].
        t = max(len(s.response_ids) for s in samples)
        out = torch.zeros(len(samples), t, device=self.device)
        mask = torch.zeros(len(samples), t, device=self.device)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            out[i, :r] = lp[i, p - 1 : p - 1 + r]
            if s.loss_mask is None:
                mask[i, :r] = 1
            else:  # tool responses in a multi-turn trajectory: context, not trained on
                mask[i, :r] = torch.tensor(s.loss_mask, dtype=mask.dtype)
        return out, mask

    def train_step(self, samples: list[TrainSample], minibatch_tokens: list[int],
                   snapshot_version: int | None = None) -> dict[str, float]:
        """Optimizer steps on this rank's share: one per mini-batch (``samples[j::M]``, M =
        ``len(minibatch_tokens)``); ``minibatch_tokens[j]`` = response tokens of mini-batch j over
        all ranks, so every step's loss is a token mean over the whole mini-batch. With
        ``snapshot_version`` the updated parameters are then copied as that version, for a
        push that runs while the next step trains (``push_weights(..., from_snapshot=True)``)."""
        t0 = time.perf_counter()
        wall0 = time.time()
        self.model.train()
        mode = self.algo.off_policy
        num_mb = len(minibatch_tokens)
        # Decoupled PPO's proximal policy is the policy before this update. Mini-batch 0 is trained from
        # it, so its own forward gives it (no extra pass at num_minibatches=1, the default); the later
        # mini-batches' samples take it from one no-grad pass before the first optimizer step.
        prox: dict[int, torch.Tensor] = {}
        if mode == "decoupled" and num_mb > 1:
            later = [i for i in range(len(samples)) if i % num_mb]
            prox = dict(zip(later, self._proximal_logprobs([samples[i] for i in later])))
        totals = {"clip": 0.0, "ratio": 0.0, "kl_b": 0.0, "kl_ref": 0.0, "tokens": 0.0, "loss": 0.0,
                  "mm_sum": 0.0, "mm_max": 0.0, "mm_over": 0.0, "mm_tokens": 0.0}
        norms = []
        for j in range(num_mb):
            idx = list(range(j, len(samples), num_mb))
            # FSDP averages gradients over ranks; scale so the sum over ranks is a global token mean.
            normaliser = max(minibatch_tokens[j], 1) / self.world_size
            self._accumulate([samples[i] for i in idx], [prox[i] for i in idx] if prox and j else None,
                             normaliser, mode, totals, before_update=j == 0)
            norms.append(self._optimizer_step())
        if self._step_delay_s > 0:
            time.sleep(self._step_delay_s)
        if self._hold is not None:
            released, timeout_s = self._hold
            try:
                if not released.wait(timeout_s):
                    raise RuntimeError(f"train step held for {timeout_s:g} s and never released (release_step)")
            finally:
                self._hold = None
        snapshot_s = 0.0
        if snapshot_version is not None:
            t1 = time.perf_counter()
            self._take_snapshot(snapshot_version)
            snapshot_s = time.perf_counter() - t1
        self.params_final()  # an armed push waiting for this version packs its first buckets now
        self._timeline.append(("train", snapshot_version, wall0, time.time()))
        tok = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"],
            "clip_frac_sum": totals["clip"],
            "ratio_sum": totals["ratio"],
            "kl_behaviour_sum": totals["kl_b"],
            "kl_ref_sum": totals["kl_ref"],
            "num_tokens": totals["tokens"],
            "grad_norm": float(sum(norms) / len(norms)),
            "ratio_mean_local": totals["ratio"] / tok,
            "mismatch_abs_sum": totals["mm_sum"],
            "mismatch_abs_max": totals["mm_max"],
            "mismatch_over_cap": totals["mm_over"],
            "mismatch_tokens": totals["mm_tokens"],
            "snapshot_seconds": snapshot_s,
            "seconds": time.perf_counter() - t0,
        }

    @torch.no_grad()
    def _proximal_logprobs(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        out = []
        mb = self.cfg.micro_batch_size
        for start in range(0, len(samples), mb):
            chunk = samples[start : start + mb]
            lp, _ = self._batch_logprobs(self.model, chunk)
            out.extend(lp[i, : len(s.response_ids)].clone() for i, s in enumerate(chunk))
        return out

    def _accumulate(self, samples: list[TrainSample], prox: list[torch.Tensor] | None, normaliser: float,
                    mode: str, totals: dict[str, float], before_update: bool) -> None:
        """Forward and backward over ``samples`` in micro-batches, adding to ``totals``. ``prox``: the
        samples' log-probs under the policy before this update (decoupled mode, later mini-batches);
        None before any optimizer step (``before_update``), where this forward's own log-probs are that
        policy. The engine-trainer mismatch is measured against it."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        for rows in micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens):
            chunk = [samples[i] for i in rows]
            lp, mask = self._batch_logprobs(self.model, chunk)
            old = torch.zeros_like(lp)
            for i, s in enumerate(chunk):
                old[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
            proximal = None
            if prox is not None:
                proximal = torch.zeros_like(lp)
                for i, r in enumerate(rows):
                    proximal[i, : prox[r].numel()] = prox[r]
            elif mode == "decoupled":
                assert before_update, "decoupled mini-batches after the first need the proximal pass"
                proximal = lp.detach()
            adv = torch.tensor([s.advantage for s in chunk], device=self.device)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self._batch_logprobs(self.ref_model, chunk)
            current = proximal if proximal is not None else (lp.detach() if before_update else None)
            if current is not None:  # the policy before this update against the engine's log-probs
                mm = mismatch_stats(current, old, mask, self.algo.is_cap)
                totals["mm_sum"] += mm.abs_sum
                totals["mm_max"] = max(totals["mm_max"], mm.abs_max)
                totals["mm_over"] += mm.over_cap
                totals["mm_tokens"] += mm.num_tokens
            out = ppo_clip_loss(lp, old, adv, mask, self.algo.clip_eps, normaliser, ref, self.algo.kl_coef,
                                mode=mode, proximal_logp=proximal, is_cap=self.algo.is_cap)
            out.loss.backward()
            totals["loss"] += out.loss.item() / self.world_size
            totals["clip"] += out.clip_frac.item()
            totals["ratio"] += out.ratio_sum.item()
            totals["kl_b"] += out.kl_behaviour_sum.item()
            totals["kl_ref"] += out.kl_ref_sum.item()
            totals["tokens"] += out.num_tokens.item()

    def _optimizer_step(self) -> float:
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        else:
            grad_norm = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in self.model.parameters() if p.grad is not None))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(grad_norm)

    def set_step_delay(self, seconds: float) -> None:
        """Sleep ``seconds`` after each step from now on (trainer.step_delay_s; tests, benchmarks)."""
        self._step_delay_s = float(seconds)

    def hold_next_step(self, timeout_s: float) -> None:
        """Tests: the next train step waits after its optimizer steps (before its snapshot) until
        ``release_step``, so that a test sets up what must happen while a step runs; after
        ``timeout_s`` without a release the step fails."""
        self._hold = (threading.Event(), float(timeout_s))

    def release_step(self) -> None:
        """Let the step held by ``hold_next_step`` finish (at once if it has not reached the hold yet).
        Called while that step runs: on the transport thread (``TrainerGroup.transport_method``)."""
        if self._hold is not None:
            self._hold[0].set()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as a full CPU tensor (inspection in tests and debugging; a collective
        under FSDP; never the weight-sync path, which moves bytes over the transport group)."""
        return {n: t.cpu().clone() for n, t in self._full_params().items()}

    # ---- checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write the model (HF layout, safetensors) and the optimizer/scheduler/RNG state under ``path``.

        Every rank must call this (under FSDP the full state dicts are gathered collectively);
        rank 0 writes the model and the full optimizer state keyed by parameter name, so
        ``load_checkpoint`` loads a checkpoint written by N workers into M. Each rank writes its
        own RNG state. ``path`` is a directory every rank reaches or an fsspec URL (each rank copies
        its files up).
        """
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.world_size > 1:
            model_sd = get_model_state_dict(self.model, options=opts)
        else:
            model_sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        optim_sd = get_optimizer_state_dict(self.model, self.opt, options=opts)
        rng = f"rng_rank{self.rank}.pt"
        with writable_dir(path) as out:  # a URL: written here, then copied up
            torch.save({"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if
                        torch.cuda.is_available() else None}, out / rng)
            mine = [rng]
            if self.rank == 0:
                self.model.save_pretrained(out, state_dict=model_sd, safe_serialization=True)
                torch.save({"optimizer": optim_sd, "scheduler": self.sched.state_dict(),
                            "world_size": self.world_size}, out / "optimizer.pt")
                # every file but the other ranks' RNG states (a shared directory holds them too)
                mine = [n for n in files_under(out) if n == rng or not _RNG_FILE.fullmatch(n)]
            t0 = time.perf_counter()
            files = digest_files(out, mine)  # read back from the page cache, before any upload
        log.info("checkpoint files of rank %d: %d bytes, digested in %.2fs", self.rank,
                 sum(f.num_bytes for f in files.values()), time.perf_counter() - t0)
        return {"rank": self.rank, "path": path, "files": {n: f.to_json() for n, f in files.items()}}

    def load_checkpoint(self, path: str, reference_path: str | None = None) -> dict[str, Any]:
        """Load a checkpoint's optimizer, scheduler and RNG state (``setup`` loaded its weights: the
        checkpoint is this worker's model path); with ``reference_path``, reload the KL reference
        model from there (the run's base model, not the checkpoint).

        Every rank must call this: the optimizer state is full and keyed by parameter name, and each
        rank keeps its own shards of it (any number of workers loads a checkpoint of any number).
        Rank r takes ``rng_rank<r>.pt``, or rank 0's if the checkpoint had fewer workers. Returns
        ``optimizer_summary`` and ``param_checksum`` (collectives under FSDP).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        src = local_copy(path, self.cache_dir)
        saved = torch.load(src / "optimizer.pt", map_location="cpu", mmap=True, weights_only=True)
        set_optimizer_state_dict(self.model, self.opt, saved["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        self.sched.load_state_dict(saved["scheduler"])
        rng_file = src / f"rng_rank{self.rank}.pt"
        if not rng_file.exists():
            log.info("%s has no RNG state of rank %d (written by %d workers): rank 0's", path, self.rank,
                     saved["world_size"])
            rng_file = src / "rng_rank0.pt"
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"][0], self.device)
        if reference_path is not None and self.ref_model is not None:
            from transformers import AutoModelForCausalLM

            self.ref_model = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        summary = {**self.optimizer_summary(), "param_checksum": self.param_checksum()}
        log.info("optimizer, scheduler and RNG state loaded from %s (written by %d workers): Adam step %d, lr %.3g",
                 path, saved["world_size"], summary["optimizer_step"], summary["lr"])
        return summary

    @torch.no_grad()
    def optimizer_summary(self) -> dict[str, float]:
        """Adam's step count, the sum of |exp_avg| over every parameter and the current learning rate
        (a collective under FSDP: every rank in lockstep). Inspection: it shows a resume loaded the state."""
        steps, total = 0, torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            st = self.opt.state.get(p)
            if st:
                t = st["exp_avg"]
                t = t.to_local() if hasattr(t, "to_local") else t
                total += t.double().abs().sum()
                steps = max(steps, int(st["step"]))
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        return {"optimizer_step": steps, "exp_avg_abs_sum": float(total), "lr": float(self.sched.get_last_lr()[0])}

    # ---- weights -------------------------------------------------------------------
    def _local_params(self) -> dict[str, torch.Tensor]:
        """Every parameter as this rank holds it (its shard under FSDP), in named_parameters order."""
        return {name: (p.detach().to_local() if hasattr(p, "to_local") else p.detach())
                for name, p in self.model.named_parameters()}

    def timeline(self) -> list[tuple[str, int | None, float, float]]:
        """The last train steps and pushes as (what, version, start, end) in wall-clock seconds
        (inspection: shows whether pushes overlapped training)."""
        return list(self._timeline)

    def _full_params(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter, in named_parameters order (a collective under FSDP:
        every rank must call this in lockstep)."""
        out = {}
        for name, p in self.model.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            out[name] = t
        return out

    # ---- inspection (tests, debugging) ---------------------------------------------
    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_tokens: int, eos_id: int) -> list[list[int]]:
        """HF greedy continuation of each prompt (rank 0, unsharded models only)."""
        self.model.eval()
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=self.device)
            g = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    do_sample=False, eos_token_id=eos_id, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
        return outs

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """The current policy's log-prob of each response token (same temperature as training)."""
        self.model.eval()
        lp, mask = self._batch_logprobs(self.model, samples)
        return [lp[i, : len(s.response_ids)].tolist() for i, s in enumerate(samples)]

    def placement_group_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_placement_group_id()

    def param_checksum(self) -> float:
        return float(sum(p.detach().double().sum().item() for p in self._full_params().values()))

    def pid(self) -> int:
        return os.getpid()
