"""The envelope of encrypted payloads and results (core/sealing.py): what it binds, what it
refuses, and the settings that hold its keys."""

from __future__ import annotations

import base64
import json

import pytest

from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.sealing import (
    MASK,
    PREFIX,
    KeyMissing,
    Keyring,
    SealError,
    is_sealed,
    masked,
    open_compensation,
    open_value,
    unseal,
)
from jobtier.worker.attempt import failure
from jobtier.worker.registry import RetryPolicy

K1 = base64.b64encode(bytes(range(32))).decode()
K2 = base64.b64encode(bytes(range(100, 132))).decode()
JOB = "01JQ0000000000000000000000-3"
OTHER = "01JQ0000000000000000000001-3"
PLAIN = b'{"card":"4111 1111 1111 1111"}'


def ring(text: str) -> Keyring:
    found = Keyring.from_text(text)
    assert found is not None
    return found


def test_a_sealed_value_is_a_marked_json_envelope_that_opens_to_the_same_bytes() -> None:
    keys = ring(f"k1:{K1}")
    sealed = keys.seal(JOB, "payload", PLAIN)
    assert sealed.startswith(PREFIX) and is_sealed(sealed) and not is_sealed(PLAIN)
    envelope = json.loads(sealed)
    assert envelope["$enc"] == "v1" and envelope["kid"] == "k1"
    assert set(envelope) == {"$enc", "kid", "n", "c"}
    assert b"4111" not in sealed
    assert keys.open(JOB, "payload", sealed) == PLAIN
    # a fresh nonce each time: the same plaintext never seals to the same bytes
    assert keys.seal(JOB, "payload", PLAIN) != sealed
    assert unseal(keys, JOB, "payload", PLAIN) == PLAIN  # a plain value passes through


def test_the_ciphertext_is_bound_to_its_job_and_part() -> None:
    keys = ring(f"k1:{K1}")
    sealed = keys.seal(JOB, "payload", PLAIN)
    with pytest.raises(SealError, match=f"job {OTHER} fails authentication"):
        keys.open(OTHER, "payload", sealed)
    with pytest.raises(SealError, match="fails authentication"):
        keys.open(JOB, "result", sealed)


def test_a_tampered_ciphertext_fails_authentication() -> None:
    keys = ring(f"k1:{K1}")
    envelope = json.loads(keys.seal(JOB, "payload", PLAIN))
    raw = bytearray(base64.b64decode(envelope["c"]))
    raw[0] ^= 1
    envelope["c"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(SealError, match="fails authentication") as info:
        keys.open(JOB, "payload", json.dumps(envelope).encode())
    assert not isinstance(info.value, KeyMissing)
    assert info.value.kind == "DecryptionFailed"
    with pytest.raises(SealError, match="not a readable envelope"):
        keys.open(JOB, "payload", PREFIX + b'"kid":[1]}')


def test_rotation_seals_with_the_first_key_and_opens_with_any() -> None:
    old = ring(f"k1:{K1}")
    rotated = ring(f"k2:{K2},k1:{K1}")
    before = old.seal(JOB, "payload", PLAIN)
    after = rotated.seal(JOB, "payload", PLAIN)
    assert json.loads(after)["kid"] == "k2" and rotated.sealing_kid == "k2"
    assert rotated.open(JOB, "payload", before) == PLAIN
    with pytest.raises(KeyMissing, match=r"key id 'k2'.*holds k1") as info:
        old.open(JOB, "payload", after)
    assert info.value.kind == "EncryptionKeyMissing"
    with pytest.raises(KeyMissing, match="no JOBTIER_ENCRYPTION_KEYS"):
        unseal(None, JOB, "payload", after)


def test_decoded_values_and_compensation_payloads_open_and_mask() -> None:
    keys = ring(f"k1:{K1}")
    sealed = keys.seal(JOB, "result", PLAIN)
    assert open_value(keys, JOB, "result", json.loads(sealed)) == {"card": "4111 1111 1111 1111"}
    assert open_value(keys, JOB, "result", [1]) == [1]
    assert masked(sealed) == MASK and masked(PLAIN) == PLAIN and masked(None) is None
    # lib.lua's compensation payload, the failed job's sealed payload inside it: opened as
    # the failed job's Redis recorded (claim.lua hands its id over)
    inner = keys.seal(JOB, "payload", PLAIN)
    comp = b'{"job_id":"' + JOB.encode() + b'","type":"t","payload":' + inner + b',"error":null}'
    opened = json.loads(open_compensation(keys, comp, JOB))
    assert opened == {"job_id": JOB, "type": "t", "payload": json.loads(PLAIN), "error": None}
    plain_comp = b'{"job_id":"x","type":"t","payload":[1],"error":null}'
    assert open_compensation(keys, plain_comp, "x") is plain_comp


def test_a_compensation_payload_opens_only_as_the_recorded_failed_job() -> None:
    keys = ring(f"k1:{K1}")
    inner = keys.seal(JOB, "payload", PLAIN)
    comp = b'{"job_id":"' + JOB.encode() + b'","type":"t","payload":' + inner + b',"error":null}'
    # a payload naming JOB in a compensation Redis made for OTHER: left sealed, not opened
    assert open_compensation(keys, comp, OTHER) is comp
    # the envelope copied under OTHER's id: bound to JOB, it fails authentication
    moved = comp.replace(JOB.encode(), OTHER.encode(), 1)
    with pytest.raises(SealError, match="fails authentication"):
        open_compensation(keys, moved, OTHER)


def test_decrypt_only_keys_open_and_never_seal() -> None:
    new = ring(f"k2:{K2}")
    phase1 = Keyring.from_text(f"k1:{K1}", f"k2:{K2}")
    assert phase1 is not None and phase1.kids == ["k1", "k2"]
    assert phase1.sealing_kid == "k1"
    assert json.loads(phase1.seal(JOB, "payload", PLAIN))["kid"] == "k1"
    # what a process already promoted to k2 seals, one still in phase 1 opens
    assert phase1.open(JOB, "payload", new.seal(JOB, "payload", PLAIN)) == PLAIN
    s = Settings.from_env(
        {"JOBTIER_ENCRYPTION_KEYS": f"k1:{K1}", "JOBTIER_DECRYPTION_KEYS": f"k2:{K2}"}
    )
    keys = s.keyring()
    assert keys is not None and keys.kids == ["k1", "k2"] and keys.sealing_kid == "k1"
    assert s.public()["decryption_keys"] == "***"
    with pytest.raises(ConfigError, match="JOBTIER_DECRYPTION_KEYS needs JOBTIER_ENCRYPTION"):
        Settings.from_env({"JOBTIER_DECRYPTION_KEYS": f"k2:{K2}"})
    with pytest.raises(ConfigError, match="JOBTIER_DECRYPTION_KEYS: key 'k2' is not base64"):
        Settings.from_env(
            {"JOBTIER_ENCRYPTION_KEYS": f"k1:{K1}", "JOBTIER_DECRYPTION_KEYS": "k2:!!"}
        )
    with pytest.raises(ConfigError, match="name the same key id"):
        Keyring.from_text(f"k1:{K1}", f"k1:{K2}")
    with pytest.raises(ConfigError, match="name the same key id"):
        Settings.from_env(
            {"JOBTIER_ENCRYPTION_KEYS": f"k1:{K1}", "JOBTIER_DECRYPTION_KEYS": f"k1:{K2}"}
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k1", "'kid:base64key'"),
        ("bad kid!:" + K1, "'kid:base64key'"),
        ("k1:not-base64!", "key 'k1' is not base64"),
        ("k1:" + base64.b64encode(b"short").decode(), "key 'k1' is 5 bytes"),
        (f"k1:{K1},k1:{K2}", "names key 'k1' twice"),
    ],
)
def test_bad_keys_are_refused_naming_the_entry_never_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        Settings.from_env({"JOBTIER_ENCRYPTION_KEYS": text})
    assert K1 not in str(info.value)


def test_the_settings_hold_the_keys_as_a_secret_and_need_them_for_encrypted_queues() -> None:
    with pytest.raises(ConfigError, match="JOBTIER_ENCRYPTED_QUEUES needs"):
        Settings.from_env({"JOBTIER_ENCRYPTED_QUEUES": "vault"})
    with pytest.raises(ConfigError, match="'a:b' is not a queue name"):
        Settings.from_env({"JOBTIER_ENCRYPTED_QUEUES": "a:b", "JOBTIER_ENCRYPTION_KEYS": f"k:{K1}"})
    s = Settings.from_env(
        {"JOBTIER_ENCRYPTED_QUEUES": "vault, pay", "JOBTIER_ENCRYPTION_KEYS": f"k1:{K1}"}
    )
    assert s.encrypted_queue_names() == {"vault", "pay"}
    assert s.public()["encryption_keys"] == "***"
    keys = s.keyring()
    assert keys is not None and keys.kids == ["k1"]
    assert Settings.from_env({}).keyring() is None


def test_a_missing_key_is_retried_and_a_failed_authentication_is_not() -> None:
    # a task that opens a dependency's result meets the same errors as the worker does
    missing = KeyMissing("the result of job x is encrypted with key id 'k9'")
    broken = SealError("the result of job x fails authentication")
    assert failure(missing, None).retry and failure(missing, None).delay_ms(RetryPolicy(), 1) > 0
    assert not failure(broken, None).retry
