"""The reward of ``disagg bench peers``' job, in the three forms disagg, verl and TRL call.

One file, copied into the job's folder, that each framework loads its own way: verl by path
(``reward.custom_reward_function.path``, ``compute_score``), TRL as a function passed to
``GRPOTrainer`` (``trl_reward``), disagg by ``reward.path=disagg.bench.peers.job_reward:score_row``. It is
the embedded reverse-digits reward (``disagg/tasks/reverse.py``): per-position credit, halved when
the length is wrong. It imports nothing, so any framework's worker can load it by path.
"""


def score(response, answer):
    """Fraction of ``answer``'s positions that ``response`` (stripped) has right; halved on a wrong length."""
    target = str(answer)
    got = str(response).strip()
    hits = sum(1 for a, b in zip(got, target) if a == b)
    value = hits / len(target)
    return value if len(got) == len(target) else value / 2


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's custom reward function (``reward.custom_reward_function.name=compute_score``)."""
    return float(score(solution_str, ground_truth))


def trl_reward(completions, answer, **kwargs):
    """TRL's reward function: one float per completion; conversational completions are message lists."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(score(t, a)) for t, a in zip(texts, answer)]


def score_row(response, row):
    """disagg's reward (``reward.path``): the row carries the answer."""
    return float(score(response, row["answer"]))
