import textwrap

import pytest

from colo.algo.rewards import (RewardError, RewardRunner, exact_match, extract_answer, format,
                               last_number, numeric, resolve)

USER_MODULE = textwrap.dedent('''
    import threading

    def length_bonus(responses, answers, prompts):
        return [len(r) / 10 for r in responses]

    def picky(responses, answers, prompts):
        # raises on one specific sample, like a parser meeting unexpected text
        return [1.0 / (0 if r == "boom" else 1) for r in responses]

    def wrong_len(responses, answers, prompts):
        return [1.0]

    def nan_on_second(responses, answers, prompts):
        return [float("nan") if i == 1 else 0.0 for i in range(len(responses))]

    def batch_only_failure(responses, answers, prompts):
        if len(responses) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    def where(responses, answers, prompts):
        return [float(threading.current_thread() is threading.main_thread())] * len(responses)
''')


@pytest.fixture
def user_mod(tmp_path, monkeypatch):
    (tmp_path / "colo_test_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "colo_test_user_rewards"


def test_extract_and_last_number():
    assert extract_answer("work\nwork\n  19  \n") == "19"
    assert extract_answer("so \\boxed{x + 1} and \\boxed{42}.") == "42"
    assert extract_answer("blah #### 7") == "7"
    assert extract_answer("The answer is 12.") == "12"
    assert extract_answer("   \n") == ""
    assert last_number("3 apples and -1,234.5 pears") == -1234.5
    assert last_number("x = 2e-3") == 0.002
    assert last_number("none here") is None


def test_exact_match_on_task_completions():
    # colo.data.tasks completions: " 7" for raw prompts, "7" inside a chat template
    assert exact_match([" 7", "7", " 7 7", " cba", "abc"], ["7", "7", "7", "cba", "cba"],
                       [""] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_builtins():
    resp = ["19", "Answer: 20", "it is 19.0000001", "nineteen", "19\n", ""]
    ans = ["19"] * 6
    prompts = ["12+7="] * 6
    assert exact_match(resp, ans, prompts) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert numeric(resp, ans, prompts) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert numeric(["1,000"], ["#### 1000"], [""]) == [1.0]
    assert format(resp, ans, prompts) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    # a response cut off by max_tokens is not cleanly formatted, whatever its text
    fr = ["stop", "length", "stop", "stop", "stop", "stop"]
    assert format(resp, ans, prompts, finish_reasons=fr) == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def test_runner_weights_user_fn_and_finish_reasons(user_mod):
    runner = RewardRunner(["numeric", f"{user_mod}:length_bonus", "format"], weights=[1.0, 0.5, 2.0])
    args = (["7", "8 and then some"], ["7", "7"], ["3+4=", "3+4="])
    s = runner.score(*args, finish_reasons=["stop", "length"])
    assert s.by_name["numeric"] == [1.0, 0.0]
    assert s.by_name[f"{user_mod}:length_bonus"] == [0.1, 1.5]
    assert s.by_name["format"] == [1.0, 0.0]
    assert s.total == pytest.approx([1.0 + 0.05 + 2.0, 0.75])
    # plain call: the weighted totals only; without finish reasons "format" judges text alone
    assert runner(*args) == pytest.approx([1.0 + 0.05 + 2.0, 0.75 + 2.0])
    runner.close()


def test_a_reward_that_declares_response_ids_gets_the_sampled_tokens() -> None:
    """colo.bench.step's default reward scores the token ids themselves (the 30B presets' ids mostly decode to no
    text): a function that declares response_ids gets them, one that does not is called as before; a raising one
    on the batch is located sample by sample with its ids sliced alike."""
    from colo.bench.stepreward import BENCH_REWARD, even_share

    runner = RewardRunner([BENCH_REWARD, "format"])
    ids = [[2, 4, 5, 7], [1], [], [10, 12]]
    s = runner.score(["a", "b", "", "c"], ["0"] * 4, ["p"] * 4, ["stop"] * 4, ids)
    assert s.by_name[BENCH_REWARD] == [0.5, 0.0, 0.0, 1.0] == even_share([], [], [], ids)
    assert s.by_name["format"] == [1.0, 1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="on sample 2"):  # no ids given: it raises on the batch, then per sample
        RewardRunner([BENCH_REWARD]).score(["a", "b", "c"], ["0"] * 3, ["p"] * 3, response_ids=[[1], [2], None])
    runner.close()


def test_resolution_errors_name_the_function(user_mod):
    with pytest.raises(ValueError, match="'exactmatch'.*built-ins"):
        RewardRunner(["exactmatch"])
    with pytest.raises(ValueError, match="no_such_mod_xyz:f.*cannot import"):
        RewardRunner(["no_such_mod_xyz:f"])
    with pytest.raises(ValueError, match=f"{user_mod}:missing.*no callable 'missing'"):
        RewardRunner([f"{user_mod}:missing"])
    with pytest.raises(ValueError, match="weights"):
        RewardRunner(["numeric"], weights=[1.0, 2.0])
    assert resolve("numeric") is numeric


def test_a_reward_given_by_its_file(tmp_path, monkeypatch):
    """"rewards.py:fn", as verl's custom_reward_function.path has it: refused until 2026-12-08 ("No module named
    '/tmp/x/rewards'"). Relative to where colo.launch runs, made absolute for the run's saved config (a resume may
    start elsewhere); two files of one name stay two modules."""
    from colo.config import load_config, resolve_paths

    for sub, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "rewards.py").write_text(f"def fn(responses, answers, prompts):\n"
                                                   f"    return [{value}] * len(responses)\n")
    monkeypatch.chdir(tmp_path)
    a, b = resolve("a/rewards.py:fn"), resolve(f"{tmp_path}/b/rewards.py:fn")
    assert (a(["x"], [""], [""]), b(["x"], [""], [""])) == ([1.0], [2.0])
    assert resolve(f"{tmp_path}/a/rewards.py:fn") is a  # loaded once per file
    assert RewardRunner(["a/rewards.py:fn", "exact_match"])(["x"], ["y"], ["p"]) == [1.0]
    with pytest.raises(ValueError, match=r"cannot import file 'c/rewards.py': FileNotFoundError: no such file"):
        resolve("c/rewards.py:fn")
    with pytest.raises(ValueError, match="no callable 'other'"):
        resolve("a/rewards.py:other")
    cfg = load_config(None, ["placement.device=cpu", "algo.rewards=[a/rewards.py:fn,exact_match,json:loads]",
                             f"run.dir={tmp_path}/run"], {})
    assert resolve_paths(cfg).algo.rewards == [f"{tmp_path}/a/rewards.py:fn", "exact_match", "json:loads"]


def test_raising_reward_names_function_and_sample(user_mod):
    runner = RewardRunner(["numeric", f"{user_mod}:picky"])
    with pytest.raises(RewardError) as ei:
        runner(["1", "2", "boom", "4"], ["1"] * 4, ["p"] * 4)
    err = ei.value
    assert err.fn_name == f"{user_mod}:picky" and err.index == 2 and err.response == "boom"
    assert "picky" in str(err) and "sample 2" in str(err) and "'boom'" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)


def test_bad_outputs_are_reward_errors(user_mod):
    with pytest.raises(RewardError, match="wrong_len.*returned 1 values for 2"):
        RewardRunner([f"{user_mod}:wrong_len"])(["a", "b"], ["a", "b"], ["", ""])
    with pytest.raises(RewardError, match="nan_on_second.*nan for sample 1") as ei:
        RewardRunner([f"{user_mod}:nan_on_second"])(["a", "b"], ["a", "b"], ["", ""])
    assert ei.value.index == 1
    with pytest.raises(RewardError, match="batch_only_failure.*no single sample") as ei:
        RewardRunner([f"{user_mod}:batch_only_failure"])(["a", "b"], ["a", "b"], ["", ""])
    assert ei.value.index is None


def test_submit_runs_off_thread_and_raises_on_result(user_mod):
    runner = RewardRunner([f"{user_mod}:where"], max_workers=1)
    assert runner.submit(["a"], ["a"], [""]).result(timeout=10).total == [0.0]  # worker thread
    picky = RewardRunner([f"{user_mod}:picky"], max_workers=1)
    with pytest.raises(RewardError, match="sample 0"):
        picky.submit(["boom"], ["x"], [""]).result(timeout=10)
    picky.close()
    inline = RewardRunner([f"{user_mod}:where"], max_workers=0)
    assert inline.submit(["a"], ["a"], [""]).result().total == [1.0]  # caller's thread
    runner.close()


# (response, reference, what the regex rewards say: exact_match, numeric) -> math says the truth
MATH_CASES = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 0.0, 0.0, 1.0),        # fraction vs decimal
    ("So x = \\boxed{\\{1,2\\}}", "\\{2,1\\}", 0.0, 0.0, 1.0),               # sets: order does not matter
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 0.0, 0.0, 1.0),                     # equal radicals
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 0.0, 0.0, 1.0),                         # equal polynomials
    ("The answer is \\boxed{3}. Check: 3+9=12", "12", 0.0, 1.0, 0.0),       # numeric reads the last number
    ("\\boxed{10\\text{ cm}}", "10", 0.0, 1.0, 1.0),                         # units
    ("\\boxed{7}", "8", 0.0, 0.0, 0.0),
    ("blue", "blue", 1.0, 0.0, 1.0),                                         # not math: string equality
    ("She sold \\boxed{72} clips.", "48/2 = 24 in May, 48+24 = 72 in all.\n#### 72", 0.0, 1.0, 1.0),  # GSM8K
]


def test_math_reward_is_right_where_the_regex_rewards_are_wrong():
    responses, answers = [c[0] for c in MATH_CASES], [c[1] for c in MATH_CASES]
    prompts = [""] * len(MATH_CASES)
    assert exact_match(responses, answers, prompts) == [c[2] for c in MATH_CASES]
    assert numeric(responses, answers, prompts) == [c[3] for c in MATH_CASES]
    runner = RewardRunner(["math"])  # resolved by name, scored off the caller's thread as the loop may
    try:
        assert runner.submit(responses, answers, prompts).result().total == [c[4] for c in MATH_CASES]
    finally:
        runner.close()
