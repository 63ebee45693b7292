"""``disagg bench peers``: one GRPO job in disagg, verl and TRL, one after another on the same machine.

``bench``: the command (run, summarise, print, plot). ``job``: the job written once for all three.
``runs``: one framework's run, launched, watched, stopped, and reduced to step records.
``disagg_run``, ``trl_run``, ``verl_run``: each framework as its users run it. ``job_reward``: the
job's reward in each framework's form. ``lengths`` and ``vllm_lengths``: the response lengths every
framework's vLLM holds, and its record of sampling steps.

Here, in ``bench``, because the job is built from the embedded model, task and config (higher parts
than ``disagg/peers/``, which the rollout and trainer import). Nothing in disagg imports this package:
only the bench's command, the frameworks' processes it starts, and vLLM's plugin loader.
"""
