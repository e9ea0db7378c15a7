"""The calculator task as an agent written against the OpenAI API: it calls the model with a
`calculator` function tool, runs the calls the model makes, and returns the reward. Nothing in
it is offstep's but the calculator itself: the same function runs against any OpenAI server.

    offstep train preset=calculator_openai
    (rollout.agent.default_agent=openai rollout.agent.openai_path=examples/agents/calculator_agent.py)
"""

import json
import re

from offstep.rollout.agents.tools import calculator  # an exact, eval-free arithmetic evaluator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly and return its value.",
            "parameters": {
                "type": "object",
                "required": ["expression"],
                "properties": {"expression": {"type": "string", "description": 'e.g. "(12 + 3) * 47"'}},
            },
        },
    }
]
MAX_TURNS = 3


async def rollout(client, row) -> dict:
    messages = list(row["messages"])
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=row["model"], messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        if not choice.message.tool_calls:  # a plain answer: score it, unless the token budget cut it
            numbers = re.findall(r"-?\d+", choice.message.content or "")  # its last number is the answer
            correct = choice.finish_reason == "stop" and bool(numbers) and numbers[-1] == str(row["ground_truth"])
            return {"score": float(correct), "acc": float(correct)}
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            try:
                answer = calculator(**json.loads(call.function.arguments))
            except Exception as exc:  # the model reads the error, as from offstep's own tool loop
                answer = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return {"score": 0.0, "acc": 0.0}  # still calling tools after MAX_TURNS turns
