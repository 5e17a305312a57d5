"""`make run`'s engine takes what agentic clients send.

Claude Code, Codex CLI and opencode send about 19,000 tokens of tools and system prompt and
ask for up to 32,000 output tokens. The engine scripts/run_local.py starts, behind a router
and an agent, must answer such a request through both official SDKs, and the answer must
end by itself at a sensible length rather than run to 32,000 tokens.
"""

from __future__ import annotations

import httpx2 as httpx
from scripts.run_local import ENGINE_OPTIONS, engine_command

from tests.ports import free_port
from tests.procs import Cluster, wait_registered, wait_until

MODEL = "run-local-model"
PROMPT_TOKENS, MAX_TOKENS = 20_000, 32_000
# The simulator counts a token per 4 bytes, as the engines' tokenizers roughly do for English.
PROMPT = "You are a coding agent with many tools. " * (PROMPT_TOKENS * 4 // 40 + 1)
CAP = int(ENGINE_OPTIONS[ENGINE_OPTIONS.index("--answer-cap") + 1])


def test_make_runs_engine_answers_an_agentic_request(make_cluster: Cluster) -> None:
    port = free_port()
    make_cluster.spawn("sim", engine_command(port, MODEL))
    engine = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(engine + "/health", timeout=1).status_code == 200)
    router = make_cluster.router()
    make_cluster.agent(router, None, "--engine", "vllm", backend_url=engine)
    wait_registered(router, MODEL)
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": PROMPT},
                {"role": "user", "content": "Refactor the parser."},
            ],
            max_tokens=MAX_TOKENS,
            timeout=60,
        )
    assert reply.usage is not None and reply.usage.prompt_tokens >= PROMPT_TOKENS
    # It ended by itself, as a model that has said what it had to say.
    assert reply.choices[0].finish_reason == "stop"
    assert 0 < reply.usage.completion_tokens <= CAP
    with router.anthropic() as claude:
        message = claude.messages.create(
            model=MODEL,
            system=PROMPT,
            messages=[{"role": "user", "content": "Refactor the parser."}],
            max_tokens=MAX_TOKENS,
            timeout=60,
        )
    assert message.usage.input_tokens >= PROMPT_TOKENS
    assert message.stop_reason == "end_turn" and 0 < message.usage.output_tokens <= CAP
