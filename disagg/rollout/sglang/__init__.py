"""The SGLang engine's package (``rollout.engine=sglang``; SGLang 0.5.17, the newest release built for
the GPU image's torch 2.11): every module of disagg that imports SGLang lives here. ``backend``: the
``EngineBackend`` over an in-process ``sglang.Engine``; ``hook``: disagg's methods on SGLang's
scheduler, which enter disagg's one receiver (``transport/model_receiver.py``); ``plugin``: what
SGLang's plugin loader (entry point ``sglang.srt.plugins``) runs in its processes. Importing this
package imports nothing of SGLang's. SGLang publishes no CPU build: it runs on GPUs only, and the
CPU suite tests these modules without it (``tests/unit/test_sglang_seam.py``).

How disagg's options reach SGLang (``backend.engine_args``; refusals in ``config/checks.py``):

- mapped: ``load_format`` (dummy/auto: ``load_format``), ``dtype``, ``max_model_len``
  (``context_length``), ``max_num_seqs`` (``max_running_requests``), ``gpu_memory_utilization``
  (``mem_fraction_static``: weights and KV pool, SGLang's activations come on top), the engine's seed
  (``random_seed``), ``enforce_eager`` (``disable_cuda_graph``), ``max_cudagraph_capture_size``
  (``cuda_graph_max_bs_decode``), ``compile=true`` (``enable_torch_compile``; null and false: its default,
  none), ``vllm_log_level`` (``log_level``, lower case), ``cpu_affinity``
  (the actor's cores, which SGLang's child processes inherit).
- refused, each by its key: ``cluster.device=cpu`` (and ``auto`` where it resolves to CPU: before Ray
  starts); ``rollout.tensor_parallel_size`` > 1 (SGLang starts its TP workers as processes of the
  engine actor, which holds one GPU bundle); ``rollout.in_flight_at_sync=keep`` (SGLang labels no token
  with its weight version and disagg counts no paused request's tokens there: ``auto`` resolves to
  ``resubmit``); ``rollout.openai_api=true`` (SGLang's OpenAI server is not behind disagg's gate,
  and the engine starts without a tokenizer; left null it is off with SGLang); ``transport.load=layerwise`` (SGLang has no layerwise
  reload: loads go straight into the live parameters, ``direct``).

Gaps against vLLM's backend (each a NotImplementedError or a value that says so):

- no OpenAI-compatible endpoint, hence no multi-turn tool agents and no engine ``/metrics``
  (``openai_app``); ``rollout.tool_call_parser`` is unused;
- no per-token version labels and no token counts at a pause (``token_version_sources`` is empty,
  ``output_counts`` raises): syncs with requests in flight resubmit them;
- per-request sampling seeds are not passed (SGLang honours ``sampling_seed`` only under its
  deterministic inference);
- ``served_version`` is disagg's own label of the weights loaded, not the engine's;
- ``tokens_generated`` is None (no count of SGLang's own);
- the benchmarks' peer routes (``peer_weight_update``, vLLM's NCCL engine and checkpoint-engine) and
  ``disagg_trace_next_sync`` have no SGLang counterpart.
"""
