from __future__ import annotations

import calendar
import hashlib
import time
from pathlib import Path

import pytest

from hivenet_router.auth.config import AuthConfigError, parse_auth
from hivenet_router.auth.keys import DigestSet, digest, generate
from hivenet_router.auth.providers import AdminKeys, AuthSettings, AuthState, StaticKeys

RAW = "sk-hivenet-test-key"
HASH = hashlib.sha256(RAW.encode()).hexdigest()


def doc(extra: str = "", models: str = "") -> str:
    return (
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{HASH}"\n'
        "      metadata: {name: prod, owner: acme" + extra + "}\n" + models
    )


def test_static_keys_authenticate_and_expire() -> None:
    config = parse_auth(doc(', expires_at: "01-01-2027"', "      models: [m1]\n"), "auth.yaml")
    provider = StaticKeys(config.keys)
    before = calendar.timegm((2027, 1, 1, 23, 59, 0, 0, 0, 0))
    principal = provider.authenticate(RAW, before)
    assert principal is not None and principal.tenant == "acme"
    assert principal.allows("m1") and not principal.allows("m2")
    after = calendar.timegm((2027, 1, 2, 0, 0, 0, 0, 0, 0))
    assert provider.authenticate(RAW, after) is None  # valid through the named day only
    assert provider.authenticate("wrong", before) is None
    assert provider.authenticate(None, before) is None
    assert provider.authenticate(HASH, before) is None  # the hash is not the key


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("api: {mode: open}\n", "api.mode: 'open' is not one of"),
        ("api: {mode: api-key}\n", "api.keys is empty"),
        ("admin: {mode: maybe}\n", "admin.mode"),
        ("api: {mode: none}\nextra: 1\n", "extra: unknown field"),
        (doc().replace(HASH, "abc"), "64 hexadecimal"),
        (doc().replace("owner: acme", "owner: ''"), "metadata.owner: must not be empty"),
        (doc(', expires_at: "2027-01-01"'), "not a DD-MM-YYYY date"),
        (doc(', expires_at: "31-02-2027"'), "not a valid date"),
        (doc() + f'    - key_hash: "{HASH}"\n      metadata: {{name: b, owner: c}}\n', "duplicate"),
        (doc("", "      models: m1\n"), "models: must be a list"),
        (doc().replace("metadata:", "metdata:"), "metdata: unknown field"),
    ],
)
def test_auth_file_errors_name_the_field(text: str, needle: str) -> None:
    with pytest.raises(AuthConfigError, match=needle):
        parse_auth(text, "auth.yaml")


def test_digest_set_and_admin_keys() -> None:
    keys = DigestSet({digest("a"): 1, digest("b"): 2})
    assert keys.find("a") == 1 and keys.find("b") == 2 and keys.find("c") is None
    admin = AdminKeys(("root-key",))
    assert admin.mode == "api-key"
    assert admin.authenticate("root-key") and not admin.authenticate("other")
    assert not admin.authenticate(None)
    assert AdminKeys(()).authenticate(None)  # none mode (allowed only explicitly)


def test_generated_keys() -> None:
    key = generate()
    assert key.raw.startswith("sk-hivenet-") and len(key.raw) > 40
    assert key.sha256 == hashlib.sha256(key.raw.encode()).hexdigest()
    assert key.preview.endswith(key.raw[-4:]) and key.raw not in key.preview
    assert time.time() > 0


@pytest.mark.parametrize(
    ("quota", "needle"),
    [
        ("{requests_per_minute: -1}", r"requests_per_minute: must be an integer from 0 to 1e\+15"),
        # Past 64 bits a limit failed its key's requests, /metrics and /admin/quotas.
        ("{tokens_per_day: 100000000000000000000}", r"tokens_per_day: must be an integer from 0"),
        ("{output_tokens_per_minute: " + "9" * 400 + "}", "output_tokens_per_minute: must be"),
        ("{tokens_per_day: 1000000000000001}", "tokens_per_day: must be an integer from 0"),
        (
            "{requests_per_minute: 5, per_model: {m: {requests_per_minute_per_replica: 1,"
            " tokens_per_day: 1}}}",
            "either flat limits or per_model",
        ),
        ("{per_model: {m: {tokens_per_day: 1}}}", "requests_per_minute_per_replica: is required"),
        ("{burst: 3}", "burst: unknown field"),
    ],
)
def test_quota_errors(quota: str, needle: str) -> None:
    with pytest.raises(AuthConfigError, match=needle):
        parse_auth(doc() + f"      quota: {quota}\n", "auth.yaml")


def test_per_model_quotas_are_the_allowlist() -> None:
    config = parse_auth(
        doc("", "      models: [x]\n") + "      quota:\n        per_model:\n"
        "          m: {requests_per_minute_per_replica: 2, tokens_per_day: 9}\n",
        "auth.yaml",
    )
    key = config.keys[0]
    assert key.models == frozenset()  # the per-model quotas decide, the list is ignored
    assert key.quota.per_model is not None and key.quota.per_model["m"].tokens_per_day == 9


def test_an_auth_file_that_is_not_utf8_is_a_config_error_and_keeps_the_keys(
    tmp_path: Path,
) -> None:
    path = tmp_path / "auth.yaml"
    digest = hashlib.sha256(b"sk-hivenet-one").hexdigest()
    path.write_text(
        f'api:\n  mode: api-key\n  keys:\n    - key_hash: "{digest}"\n'
        "      metadata: {name: a, owner: a}\n"
    )
    state = AuthState(AuthSettings(str(path), "", (), True))
    path.write_bytes(path.read_bytes() + b"# caf\xe9\n")  # one Latin-1 byte
    assert state.reload() is False
    assert state.client.authenticate("sk-hivenet-one", 0.0) is not None
    with pytest.raises(AuthConfigError, match="not UTF-8"):
        AuthState(AuthSettings(str(path), "", (), True))


@pytest.mark.parametrize("mode", ["api_key", "None", " none", "static"])
def test_an_unknown_env_mode_is_refused_not_taken_for_dynamic(mode: str) -> None:
    # Every value but none and api-key once meant dynamic mode.
    with pytest.raises(AuthConfigError, match="none, api-key, dynamic"):
        AuthState(AuthSettings("", mode, ("admin-key",), False))


def test_dynamic_mode_from_the_environment_needs_admin_keys() -> None:
    with pytest.raises(AuthConfigError, match="HIVENET_ROUTER_ADMIN_API_KEYS"):
        AuthState(AuthSettings("", "dynamic", (), True))
    assert AuthState(AuthSettings("", "dynamic", ("admin-key",), False)).client.mode == "dynamic"


def test_an_auth_file_nested_too_deeply_is_a_config_error() -> None:
    with pytest.raises(AuthConfigError, match=r"auth\.yaml: nested too deeply"):
        parse_auth("[" * 3000, "auth.yaml")
