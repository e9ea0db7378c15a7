"""Environments from the ecosystem, trained unchanged (docs/environments.md): verifiers tasksets
(``env.kind=verifiers``) and OpenEnv servers (``env.kind=openenv``). Each becomes offstep's
OpenAI-agent rollout (``offstep.rollout.agents.openai_agent``): the environment's own loop talks to the
replica's endpoint, which records every token. The libraries are imported only by a run that
names them."""
