"""The three ways of continuing in-flight samples across a weight load (``rollout.partial``), on
SmolLM2-135M-Instruct with the built-in engine: the mismatch of the tokens sampled after the load
against the new weights' teacher-forced log-probs, and the cost, side by side in one run.

The "new" weights are the model moved by one Adam-sized step at the default preset's learning rate
(every parameter by ``lr`` times a random sign: the size of an early Adam update), so the mismatch
is that of one real policy version. 8 arithmetic prompts x 4 samples, up to 48 new tokens, T = 1;
the load is posted once ``LOAD_AT`` tokens have been sampled in all (about a third of the way).

    .venv/bin/python -m benchmarks.partial_modes      # writes benchmarks/results/results_partial.md
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from benchmarks.common import RESULTS, cpu_kind_and_dtype
from benchmarks.readme import refresh
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.rollout.engines.control import StepControl
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.stream.replica_stream import StreamFeed
from offstep.rollout.types import SamplingParams, TurnRequest

PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=48)
LR = 1e-5  # the default preset's actor.optim.lr
LOAD_AT = 32 * 12  # tokens sampled in all before the load is posted
REPEATS = 3
OUT = RESULTS / "results_partial.md"


def _prompts(tok) -> list[list[int]]:
    qs = [f"What is {a} + {b}?" for a, b in ((3, 4), (7, 2), (5, 5), (9, 1), (6, 3), (8, 8), (2, 7), (4, 0))]
    return [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in qs
    ]


def _serve(engine, prompts, partial, new, at):
    """One serve of ``prompts`` x n with a load of ``new`` posted after ``at`` tokens; returns the
    completions, the wall time, and the seconds from the post to the load."""
    requests = [
        TurnRequest(i, prompts[i // PARAMS.n], i, PARAMS.max_new_tokens, i // PARAMS.n)
        for i in range(len(prompts) * PARAMS.n)
    ]
    feed, control = StreamFeed(prompts, 64), StepControl(partial)
    control.attach(feed.wake)
    done, count, posted, landed = {}, [0], [0.0], [0.0]
    append = engine._append

    def apply():
        landed[0] = time.perf_counter()
        engine.load_weights(new, 1)

    def counting(row, token, lp, params, window):
        count[0] += 1
        if count[0] == at:
            posted[0] = time.perf_counter()
            control.post_load(apply)
        return append(row, token, lp, params, window)

    def on_finish(i, c):
        done[i] = c
        if len(done) == len(requests):
            feed.close()

    engine._append = counting
    feed.put(requests)
    t0 = time.perf_counter()
    t = threading.Thread(target=engine.serve, args=(feed, PARAMS, 11, on_finish, control))
    t.start()
    t.join()
    wall = time.perf_counter() - t0
    del engine._append
    return [done[i] for i in range(len(requests))], wall, landed[0] - posted[0]


@torch.no_grad()
def _teacher(model, prompt, response):
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / PARAMS.temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    path = resolve_model("smollm2-135m-instruct")
    tok = load_tokenizer(path)
    model = load_causal_lm(path)
    engine = TorchEngine(model, tok, eos_token_ids(tok, path), max_batch_size=64)
    prompts = _prompts(tok)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    new = {n: p + LR * torch.sign(torch.randn(p.shape, generator=gen)) for n, p in old.items()}
    rows = []
    for partial in ("keep", "recompute", "off"):
        walls, waits = [], []
        for _ in range(REPEATS):
            engine.load_weights(old, 0)
            completions, wall, wait = _serve(engine, prompts, partial, new, LOAD_AT)
            walls.append(wall)
            waits.append(wait)
        # The mismatch, from the last repeat: every token after the load against the new weights'
        # teacher-forced log-probs (the weights the engine holds now), and the tokens before it
        # against the old weights'.
        diffs_new, diffs_old, crossed = [], [], 0
        teacher_new = [_teacher(model, prompts[i // PARAMS.n], c.response_ids) for i, c in enumerate(completions)]
        engine.load_weights(old, 0)
        for i, c in enumerate(completions):
            vs = c.versions
            cut = vs.index(1) if 1 in vs else len(vs)
            crossed += 0 < cut < len(vs)
            lp = torch.tensor(c.logprobs)
            diffs_new.append(lp[cut:] - teacher_new[i][cut:])
            diffs_old.append(lp[:cut] - _teacher(model, prompts[i // PARAMS.n], c.response_ids)[:cut])
        after, before = torch.cat(diffs_new), torch.cat(diffs_old)
        nan = float("nan")  # off: no token is sampled after the load in a sample that began before it
        rows.append(
            (
                partial,
                crossed,
                len(completions),
                int(after.numel()),
                float(after.mean()) if after.numel() else nan,
                float(after.abs().max()) if after.numel() else nan,
                float(before.abs().max()),
                statistics.median(walls),
                statistics.median(waits),
            )
        )
        print(rows[-1], flush=True)
    base = rows[0][7]
    lines = [
        "# rollout.partial: mismatch and cost of each way of continuing across a weight load",
        "",
        f"`.venv/bin/python -m benchmarks.partial_modes` on {cpu_kind_and_dtype()}, 1 thread; "
        f"{time.strftime('%Y-%m-%d')}. SmolLM2-135M-Instruct, float32, built-in engine (slot runner); 8 prompts x "
        f"{PARAMS.n} samples, up to {PARAMS.max_new_tokens} new tokens, T = 1; the new weights are the model moved by "
        f"{LR:g} x a random sign per parameter (one Adam-sized step at the default lr); the load is posted after "
        f"{LOAD_AT} tokens. Times: median of {REPEATS} serves; other work may have shared the cores.",
        "",
        "| partial | samples that crossed the load | tokens after the load | k1 = mean(rollout - new weights) after | "
        "max abs after | max abs before (vs old weights) | serve s | ratio to keep | post-to-load s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p, crossed, total, n_after, k1, mx, mx_before, wall, wait in rows:
        lines.append(
            f"| `{p}` | {crossed}/{total} | {n_after} | {k1:.2e} | {mx:.2e} | {mx_before:.2e} | {wall:.2f} | "
            f"{wall / base:.2f} | {wait:.3f} |"
        )
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text())
    refresh("partial")


if __name__ == "__main__":
    main()
