"""The Responses API through real processes and the official SDK: plain and streamed
answers (events in order, numbered), structured output, a client-side function tool round
trip, stored responses (read, list, delete, continue, expire, isolation between tenants),
store: false, a client that hangs up mid-stream, and bad input (a 400 with a stable code,
never a 500)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import orjson
import pytest
from pydantic import BaseModel

from tests.integration.test_auth import auth_file, entry
from tests.procs import Cluster, Router, cluster, metric, wait_registered, wait_until

MODEL = "m"
KEY, OTHER = "sk-hivenet-responses-one", "sk-hivenet-responses-two"
HELD = (
    "hivenet_router_active_forwards",
    "hivenet_router_pending_requests",
    "hivenet_agent_capacity_utilization",
    "hivenet_agent_link_streams",
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Router]]:
    tmp = tmp_path_factory.mktemp("responses")
    with cluster(tmp) as c:
        path = auth_file(tmp, entry(KEY, "acme"), entry(OTHER, "beta"))
        router = c.router("--auth-config-file", str(path))
        c.agent(router, c.sim(MODEL, "--zero-latency"))
        wait_until(lambda: [m.id for m in router.openai(KEY).models.list()] == [MODEL])
        yield c, router
        held = router.metrics()
        for name in HELD:
            assert metric(held, name) == 0.0, name
        for proc in c.procs:
            assert "Traceback" not in proc.log(), proc.name


def _post(router: Router, body: Any, key: str = KEY) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(
        router.url + "/v1/responses",
        content=content,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=20,
    )


def test_plain_create_is_a_response_metered_once(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    client = router.openai(KEY)
    response = client.responses.create(
        model=MODEL, input="Say hello.", instructions="Be brief.", metadata={"k": "v"}
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.output_text
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"}
    usage = response.usage
    assert usage is not None and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # One meter: the audit record counts what the Response reports.
    rid = response._request_id
    wait_until(lambda: any(r["request_id"] == rid for r in router.audit_records()))
    (record,) = [r for r in router.audit_records() if r["request_id"] == rid]
    assert (record["input_tokens"], record["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    assert record["status_code"] == 200 and record["tenant_id"] == "acme"
    text = router.metrics()
    assert 'route="/v1/responses"' in text


def _events(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_streamed_create_sends_the_events_in_order(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    client = router.openai(KEY)
    events = _events(client.responses.create(model=MODEL, input="Say hello.", stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 0
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    assert final.usage is not None and final.usage.output_tokens > 0
    # The stored Response is the one the stream ended with.
    assert client.responses.retrieve(final.id).output_text == text
    # The SDK's helper assembles the same.
    with client.responses.stream(model=MODEL, input="Again.") as stream:
        assert stream.get_final_response().status == "completed"


def test_max_output_tokens_ends_incomplete(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    client = router.openai(KEY)
    whole = client.responses.create(model=MODEL, input="Talk.", max_output_tokens=3)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 3
    events = _events(
        client.responses.create(model=MODEL, input="Talk.", max_output_tokens=3, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 3


class City(BaseModel):
    name: str
    population: int


def test_parse_reads_structured_output(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    parsed = router.openai(KEY).responses.parse(
        model=MODEL, input="A city, please.", text_format=City
    )
    assert isinstance(parsed.output_parsed, City)
    client = router.openai(KEY)
    with client.responses.stream(model=MODEL, input="A city.", text_format=City) as stream:
        assert isinstance(stream.get_final_response().output_parsed, City)


def test_function_tool_round_trip(fleet: tuple[Cluster, Router]) -> None:
    """The model calls the client's function; the result goes back, once by
    previous_response_id and once as the whole conversation: the engine reads the same
    prompt both ways."""
    _, router = fleet
    client = router.openai(KEY)
    question = {"role": "user", "content": "Weather in Oslo?"}
    first = client.responses.create(
        model=MODEL, input=[question], tools=[WEATHER], tool_choice="required"
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and orjson.loads(call.arguments).keys() == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}
    continued = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER]
    )
    assert continued.previous_response_id == first.id and continued.output_text
    whole = client.responses.create(
        model=MODEL,
        input=[question, call.model_dump(exclude_none=True), result],
        tools=[WEATHER],
    )
    assert continued.usage is not None and whole.usage is not None
    assert continued.usage.input_tokens == whole.usage.input_tokens
    # Streamed, the call arrives as function_call_arguments events.
    events = _events(
        client.responses.create(
            model=MODEL, input=[question], tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert orjson.loads(done.arguments).keys() == {"city"}


def test_stored_response_read_listed_deleted(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    client = router.openai(KEY)
    created = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
        ],
    )
    assert client.responses.retrieve(created.id).output_text == created.output_text
    items = client.responses.input_items.list(created.id)
    assert [i.role for i in items.data] == ["user", "developer"]  # newest first
    ascending = client.responses.input_items.list(created.id, order="asc", limit=1)
    assert [i.role for i in ascending.data] == ["developer"] and ascending.has_more
    following = client.responses.input_items.list(
        created.id, order="asc", limit=1, after=ascending.data[0].id
    )
    assert [i.role for i in following.data] == ["user"] and not following.has_more
    # A cursor from no page of this list is an error, not a silent end of the list.
    with pytest.raises(openai.BadRequestError) as stale:
        client.responses.input_items.list(created.id, after="msg_from_elsewhere")
    assert stale.value.code == "invalid_parameter" and stale.value.param == "after"
    # An unknown ID is named in the 404, but a huge one is not echoed whole.
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.retrieve("resp_" + "x" * 3000)
    assert unknown.value.code == "response_not_found" and len(unknown.value.message) < 300
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(created.id)
    assert refused.value.code == "response_not_cancellable"
    client.responses.delete(created.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as gone:
            call(created.id)
        assert gone.value.code == "response_not_found"


def test_a_tenant_never_reaches_another_tenants_response(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    mine = router.openai(KEY).responses.create(model=MODEL, input="Secret.")
    theirs = router.openai(OTHER)
    calls = [
        lambda: theirs.responses.retrieve(mine.id),
        lambda: theirs.responses.input_items.list(mine.id),
        lambda: theirs.responses.cancel(mine.id),
        lambda: theirs.responses.delete(mine.id),
        lambda: theirs.responses.create(model=MODEL, input="Go on.", previous_response_id=mine.id),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.code == "response_not_found"
    # Still there for its owner.
    assert router.openai(KEY).responses.retrieve(mine.id).id == mine.id


def test_store_false_keeps_nothing(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    client = router.openai(KEY)
    for stream in (False, True):
        if stream:
            events = _events(
                client.responses.create(model=MODEL, input="x", store=False, stream=True)
            )
            response_id = events[-1].response.id
        else:
            response_id = client.responses.create(model=MODEL, input="x", store=False).id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)


HOSTED = [
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "mcp",
    "image_generation",
    "local_shell",
]


@pytest.mark.parametrize("tool", HOSTED)
def test_hosted_tools_are_refused_by_name(fleet: tuple[Cluster, Router], tool: str) -> None:
    _, router = fleet
    reply = _post(router, {"model": MODEL, "input": "x", "tools": [WEATHER, {"type": tool}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "unsupported_tool" and error["param"] == "tools[1].type"
    assert repr(tool) in error["message"]


BAD = [
    (b"{not json", "request_invalid"),
    (b"[]", "request_invalid"),
    ({"input": "x"}, "request_invalid"),
    ({"model": MODEL, "input": 5}, "request_invalid"),
    ({"model": MODEL, "input": [{"type": "nope"}]}, "unsupported_parameter"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "request_invalid"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "invalid_parameter"),
    ({"model": MODEL, "input": "x", "stream": "yes"}, "request_invalid"),
    (
        {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}},
        "request_invalid",
    ),
    ({"model": MODEL, "input": "x", "tool_choice": {"type": "web_search"}}, "unsupported_tool"),
    ({"model": MODEL, "input": "x", "background": True}, "unsupported_parameter"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, "response_not_found"),
    (
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
        "unsupported_parameter",
    ),
]


@pytest.mark.parametrize(("body", "code"), BAD)
def test_bad_input_is_a_stable_4xx(fleet: tuple[Cluster, Router], body: Any, code: str) -> None:
    _, router = fleet
    reply = _post(router, body)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["code"] == code


def test_hang_up_mid_stream_frees_what_it_held(tmp_path: Path) -> None:
    # A budget, so that the stream holds an occupancy reservation the check can see.
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "admit_budget_tokens: 10000000\nmax_inflight: 1000\n"
        "routing_policy: {strategy: least-loaded}\n"
    )
    reserved = ("hivenet_admission_occupancy_tokens", "hivenet_admission_inflight_requests")
    with cluster(tmp_path) as c:
        router = c.router("--policy-file", str(policy))
        sim = c.sim(MODEL, "--itl", "50ms", "--ttft-base", "0")
        c.agent(router, sim)
        wait_registered(router, MODEL)
        body = {"model": MODEL, "input": "Talk.", "max_output_tokens": 200, "stream": True}
        url = router.url + "/v1/responses"
        with httpx.stream("POST", url, json=body, timeout=20) as reply:
            lines = reply.iter_lines()
            seen = [next(lines) for _ in range(16)]
            assert any("response.output_text.delta" in line for line in seen)
            assert metric(sim.metrics(), "vllm:num_requests_running") == 1.0
            held = router.metrics()
            holding = (*reserved, "hivenet_router_active_forwards", "hivenet_agent_link_streams")
            assert all(metric(held, name) for name in holding)
        wait_until(lambda: metric(sim.metrics(), "vllm:num_requests_running") == 0.0)
        for name in (*HELD, *reserved):
            wait_until(lambda name=name: metric(router.metrics(), name) == 0.0)
        assert router.openai().responses.create(model=MODEL, input="x", max_output_tokens=2)


def test_stored_responses_expire(tmp_path: Path) -> None:
    """--responses-store-ttl: past it a response reads as absent (the exact bound is
    checked in virtual time in tests/unit/responses/test_store.py)."""
    with cluster(tmp_path) as c:
        router = c.router("--responses-store-ttl", "1s")
        c.agent(router, c.sim(MODEL, "--zero-latency"))
        wait_registered(router, MODEL)
        client = router.openai()
        created = client.responses.create(model=MODEL, input="x")

        def gone() -> bool:
            try:
                client.responses.retrieve(created.id)
            except openai.NotFoundError:
                return True
            return False

        wait_until(gone, timeout=10)


def test_what_the_router_writes_matches_the_official_spec(fleet: tuple[Cluster, Router]) -> None:
    """Responses, stream events, item lists and deletions, each against the schema the
    official OpenAI document gives it."""
    from tests.conformance import specs  # loads the specs only here

    _, router = fleet
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "tool_choice": "required"}
    whole = _post(router, body).json()
    found = specs.violations("openai", "Response", whole)
    streamed = httpx.post(
        router.url + "/v1/responses",
        json={**body, "tool_choice": "auto", "stream": True, "max_output_tokens": 4},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=20,
    )
    for line in streamed.text.splitlines():
        if line.startswith("data: "):
            found += specs.violations("openai", "ResponseStreamEvent", orjson.loads(line[6:]))
    url = f"{router.url}/v1/responses/{whole['id']}"
    auth = {"Authorization": f"Bearer {KEY}"}
    listed = httpx.get(url + "/input_items", headers=auth, timeout=5).json()
    found += specs.violations("openai", "ResponseItemList", listed)
    assert httpx.delete(url, headers=auth, timeout=5).json()["deleted"] is True
    assert not found, sorted({(v.schema, v.path, v.validator, v.message[:80]) for v in found})


def test_with_a_ledger_responses_are_billed_and_shared_by_the_site(tmp_path: Path) -> None:
    """With --ledger-dsn the wallet bills a Response as the chat request it is, and the
    stored responses live in PostgreSQL: a response made on one router is read and
    continued on another."""
    from tests.integration.test_gateway import PRICES, charges, credit
    from tests.postgres import postgres_server

    policy = tmp_path / "policy.yaml"
    policy.write_text(PRICES + "routing_policy: {strategy: least-loaded}\n")
    with postgres_server() as pg, cluster(tmp_path) as c:
        dsn = pg.database()
        first, second = (
            c.router("--ledger-dsn", dsn, "--policy-file", str(policy), name=name)
            for name in ("router-a", "router-b")
        )
        sim = c.sim(MODEL, "--zero-latency")
        for router in (first, second):
            c.agent(router, sim, name=f"agent-{router.http}")
            wait_registered(router, MODEL)
        credit(first, "100")
        made = first.openai().responses.create(model=MODEL, input="Hello.")
        wait_until(lambda: any(e["request_id"] == made._request_id for e in charges(first)))
        client = second.openai()
        assert client.responses.retrieve(made.id).output_text == made.output_text
        continued = client.responses.create(
            model=MODEL, input="And then?", previous_response_id=made.id
        )
        assert continued.usage is not None and made.usage is not None
        assert continued.usage.input_tokens > made.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_" + "0" * 48)


def test_the_response_cache_serves_responses_as_chat(make_cluster: Cluster, tmp_path: Path) -> None:
    """The cache stage keys the chat request a Response becomes: the second identical
    request is served from it, as a Response with an ID of its own, stream or not."""
    from tests.integration.test_response_cache import ACME, engine_calls, start

    router, sim = start(make_cluster, tmp_path, "{}")
    client = router.openai(ACME)
    asked = {"model": MODEL, "input": "Tell me something.", "temperature": 0}
    first = client.responses.create(**asked)  # type: ignore[call-overload]
    calls = engine_calls(sim)
    again = client.responses.create(**asked)  # type: ignore[call-overload]
    assert engine_calls(sim) == calls
    assert again.output_text == first.output_text and again.id != first.id
    assert client.responses.retrieve(again.id).id == again.id
    stream_events = _events(client.responses.create(**asked, stream=True))  # type: ignore[call-overload]
    _events(client.responses.create(**asked, stream=True))  # type: ignore[call-overload]
    assert engine_calls(sim) == calls + 1
    assert stream_events[-1].type == "response.completed"
    assert metric(router.metrics(), "hivenet_cache_requests_total", result="hit") == 2.0
