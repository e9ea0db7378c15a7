"""Tools for offstep's agent loop: a complete example file (docs/tools-and-agents.md: "Writing a tool").

Run with, e.g. (Qwen2.5-style templates use the hermes format; SmolLM2 the tag format):

    offstep train data.train_files=[examples/tools/shop.jsonl] data.val_files=[examples/tools/shop.jsonl] \
        rollout.agent.tools_path=examples/tools/shop_tools.py rollout.agent.tools=[price,convert,calculator] \
        rollout.agent.format=tag reward.custom_path=examples/tools/shop_tools.py reward.custom_name=compute_score

A tool is a plain function, sync or async, taking JSON values and returning a string. Its
OpenAI-style schema is read from the type hints and the Google-style docstring (the "Args:" lines
become the parameters' descriptions), or given explicitly as ``fn.schema``. Raising, returning a
non-string or running past rollout.agent.tool_timeout_s is not fatal: the model reads an
"Error: ..." text instead and the call counts in agent/tool_errors.
"""

import asyncio

RATES = {"EUR": 1.0, "USD": 1.08, "GBP": 0.85}


def convert(amount: float, currency: str) -> str:
    """Convert an amount of euros into another currency.

    Args:
        amount: the amount in euros
        currency: the currency to convert to: USD, GBP or EUR
    """
    rate = RATES.get(currency.upper())
    if rate is None:
        raise ValueError(f"unknown currency {currency!r}; known: {sorted(RATES)}")  # the model reads this
    return f"{amount * rate:.2f} {currency.upper()}"


async def price(item: str, catalogue: dict | None = None) -> str:
    """Look up the price of an item in the shop's catalogue, in euros.

    Args:
        item: the item's name
        catalogue: the row's own catalogue (from the row's extra_info.tools_kwargs, never from the model)
    """
    await asyncio.sleep(0)  # an async tool may await I/O here (a database, a local service)
    found = (catalogue or {}).get(item.strip().lower())
    return "not in the catalogue" if found is None else f"{found} EUR"


# The schema may also be written by hand (it is what a chat template with tool support renders into
# the prompt); the per-row argument `catalogue` is left out: the model does not set it.
price.schema = {
    "type": "function",
    "function": {
        "name": "price",
        "description": "Look up the price of an item in the shop's catalogue, in euros.",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string", "description": "the item's name"}},
            "required": ["item"],
        },
    },
}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's reward signature. With tools, extra_info also holds num_turns, tool_calls (name,
    arguments, well_formed, error, ran per call), final_text (the model's last turn) and ended_by
    (answer | budget | max_turns). Only a final answer counts: not a call, not a cut-off turn."""
    info = extra_info or {}
    final = info.get("final_text", solution_str)
    correct = info.get("ended_by", "answer") == "answer" and str(ground_truth) in final
    used_tool = any(call["ran"] and not call["error"] for call in info.get("tool_calls", []))
    return {"score": float(correct), "acc": float(correct), "used_tool": float(used_tool)}
