"""Secrets in a config: the field names that hold them, one walk that finds them and redacts
them, and scrubbing them from text a backend echoes. No other module of the package is read
here, so anything may import it."""

import dataclasses
import re
from typing import Any

#: The words of a name (``HF_TOKEN``, ``--hf-token``, ``wandbApiKey``, ``logger.comet_api_key``),
#: lower-cased: split at ``_ - .``, spaces and camel case.
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
#: Words that name a credential wherever they stand in a name.
_CREDENTIAL_WORDS = frozenset(
    {"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials", "apikey", "apitoken"}
    | {"authtoken", "accesstoken", "oauth", "authorization", "authentication"}
)
#: Words that make a credential of the word ``key`` after them (``api_key``, ``private_key``).
_KEY_QUALIFIERS = frozenset({"api", "private", "secret", "access", "signing", "session", "auth"})
#: Words before a final ``token`` that make it a vocabulary item, not a credential (``pad_token``,
#: ``eos_token``, ``tiktoken_num_special_tokens`` has no final ``token`` at all).
_VOCABULARY = frozenset(
    {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "eod", "sot", "eot", "start", "end", "stop", "special"}
    | {"image", "video", "audio", "first", "last", "max", "min", "num", "next", "prompt", "placeholder"}
    | {"fim", "prefix", "middle", "suffix", "boi", "eoi", "vision", "think", "tool"}
)


def name_words(name: str) -> list[str]:
    """The lower-cased words of ``name`` (``--hf-token`` -> ["hf", "token"], ``wandbApiKey`` ->
    ["wandb", "api", "key"])."""
    return [word.lower() for word in _WORDS.findall(name)]


def secret_name(name: str) -> bool:
    """Whether a field, option, variable or override named ``name`` holds a credential: the ONE rule
    of the package (the config's fields, facts, a command's options and assignments, the environment).

    By what the words say, not by substrings: a password, passphrase, secret or credential anywhere
    (``mlflow_password``, ``AWS_SECRET_ACCESS_KEY``); an api, private, secret, access or auth ``key``
    (``--wandb-api-key``, ``COMET_API_KEY``, ``apiKey``); ``auth`` alone or ``oauth``; ``token`` as
    the name's last word, unless it names a vocabulary item (``HF_TOKEN``, ``--hf-token``,
    ``auth_token``, not ``pad_token``). Megatron-LM's ``--tokenizer-type``, ``--max-tokens-to-oom``,
    ``--moe-token-dispatcher-type`` or ``eos_token_id`` are not secrets."""
    words = name_words(name)
    if not words:
        return False
    if any(word in _CREDENTIAL_WORDS for word in words) or words[-1] == "auth":
        return True
    for before, word in zip(["", *words], words):
        if word == "key" and before in _KEY_QUALIFIERS:
            return True
    return words[-1] == "token" and (len(words) < 2 or words[-2] not in _VOCABULARY)


class _SecretNames:
    """``SECRET_NAME.search(name)``: ``secret_name``, for code written against the pattern it replaced."""

    def search(self, name: str) -> bool:
        return secret_name(name)


#: secret_name, spelled as the pattern it replaced (``SECRET_NAME.search(name)``): one rule either way.
SECRET_NAME = _SecretNames()
REDACTED = "***redacted***"
#: A URI's credentials: ``scheme://user:password@`` (the password: group 2; user and password: group 1).
_URI_CREDENTIALS = re.compile(r"(?<=://)(([^/?#@:\s]*):([^/?#@\s]*))@")
#: What replaces a URI's password: ``http://alice:***@host``.
URI_PASSWORD = "***"


def uri_credentials(value: Any) -> list[str]:
    """The credentials in a URI-valued string (``"user:password"`` and ``"password"``), or []."""
    if not isinstance(value, str) or "://" not in value:
        return []
    found = []
    for match in _URI_CREDENTIALS.finditer(value):
        password = match.group(3)
        if password and password != URI_PASSWORD:
            found += [match.group(1), password]
    return found


def redact_uri(value: Any) -> Any:
    """``value`` with any URI's password replaced by ``***`` (``http://alice:***@host``); else as is."""
    if not isinstance(value, str) or "://" not in value:
        return value
    return _URI_CREDENTIALS.sub(lambda m: f"{m.group(2)}:{URI_PASSWORD}@" if m.group(3) else m.group(0), value)


def redact(config: Any) -> tuple[Any, list[str]]:
    """One walk of ``config``: (a copy safe to record, in which secret-looking fields are
    REDACTED; the secret strings found, to scrub from anything a backend echoes).

    The copy is plain dicts, lists and scalars: a dataclass or an object with attributes becomes
    the dict of its fields, anything else unknown its ``str``. A secret is a non-empty value
    under a name that names a credential (``secret_name``); strings within such a value are secrets too. A
    URI's ``user:password`` (``http://alice:pw@host``, any field) is recorded as ``alice:***`` and
    its password is a secret."""
    found: list[str] = []

    def secrets_in(value) -> None:  # a secret-named value: every string in it
        if isinstance(value, str):
            if value:
                found.append(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                secrets_in(getattr(value, f.name))
        elif hasattr(value, "items"):
            for item in value.values():
                secrets_in(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                secrets_in(item)

    def walk(value, name: str = ""):
        if name and secret_name(name) and value not in (None, ""):
            secrets_in(value)
            return REDACTED
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: walk(getattr(value, f.name), f.name) for f in dataclasses.fields(value)}
        if isinstance(value, dict) or hasattr(value, "items"):
            return {str(k): walk(v, str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if isinstance(value, str):
            credentials = uri_credentials(value)
            found.extend(credentials)
            return redact_uri(value) if credentials else value
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if hasattr(value, "__dict__"):
            return {k: walk(v, k) for k, v in vars(value).items() if not k.startswith("_")}
        return str(value)

    return walk(config), found


def flattened(value: Any) -> dict[str, Any]:
    """A redacted copy (``redact``'s first item) flattened to ``{"a.b": value}``."""
    out: dict[str, Any] = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", value)
    return out


def flat_params(config: Any) -> dict[str, Any]:
    """The redacted config flattened to ``{"a.b": value}``, as hyperparameter stores want it."""
    return flattened(redact(config)[0])


def secrets_of(config: Any) -> list[str]:
    """The secret values in a config (to scrub from anything a backend echoes)."""
    return redact(config)[1]


def scrubbed(value: Any, secrets: list[str]) -> Any:
    """``value`` with every secret string in it replaced by REDACTED (non-strings unchanged)."""
    if isinstance(value, str):
        for secret in sorted(filter(None, secrets), key=len, reverse=True):  # "user:pw" before "pw"
            value = value.replace(secret, REDACTED)
    return value


#: An option or assignment in a command's text, and its value: ``--wandb-api-key V``, ``--comet-api-key=V``,
#: ``COMET_API_KEY=V``, ``logger.wandb_api_key=V`` (quotes around V left out). The name is matched
#: alone and the value looked ahead, so an option followed by another option misses neither.
_NAMED_VALUE = re.compile(r"""(?:^|(?<=[\s'";(]))(-{0,2}[\w.-]+)(?=(=|\s+)(["']?)([^\s'";)]+))""")
#: Values never taken for a secret however they are named (a flag's switch, a placeholder): scrubbing
#: them would take every ``1`` or ``true`` out of what is shown.
_NOT_SECRETS = {"true", "false", "none", "null", "yes", "no", "auto", "off", "on"}
#: The shortest value taken for a secret (shorter ones would scrub ordinary words and numbers).
MIN_SECRET = 4


def _plausible(value: str) -> bool:
    return len(value) >= MIN_SECRET and value.lower() not in _NOT_SECRETS


def command_secrets(command: list[str]) -> list[str]:
    """The secret values in a command line: a secret-named option's value (``--wandb-api-key V`` as
    two arguments or in one shell string, ``--comet-api-key=V``), a secret-named assignment's
    (``COMET_API_KEY=V``, ``logger.wandb_api_key=V``), a URI's credentials; any argument, also
    inside a ``bash -c`` string. Values shorter than MIN_SECRET, or a switch's ``true``, are not."""
    found: list[str] = []
    for index, part in enumerate(command):
        found += uri_credentials(part)
        if part.startswith("-") and "=" not in part and secret_name(part) and index + 1 < len(command):
            found.append(command[index + 1])
        for match in _NAMED_VALUE.finditer(part):
            key, separator, value = match.group(1), match.group(2), match.group(4)
            if secret_name(key) and (separator == "=" or key.startswith("-")):
                found.append(value)
    return sorted({value for value in found if _plausible(value)}, key=len, reverse=True)


def environ_secrets(environ: dict[str, str]) -> list[str]:
    """The values of secret-named environment variables (``WANDB_API_KEY``, ``HF_TOKEN``) and the
    credentials of URI-valued ones, as command_secrets takes them."""
    found: list[str] = []
    for name, value in environ.items():
        found += [value] if secret_name(name) else uri_credentials(value)
    return [value for value in found if _plausible(value)]


def scrubbed_text(text: str, secrets: list[str]) -> str:
    """``text`` with every secret in ``secrets`` REDACTED and any URI's password ``***``: for output
    that may echo them anywhere. Linear in the text's length for each secret."""
    return scrubbed(redact_uri(text), secrets)


def launch_secrets(command: list[str], environ: dict[str, str]) -> list[str]:
    """The secrets a launched command may echo (fit's probes, ``run``): its command line's and its
    environment's, longest first (so ``user:pw`` is scrubbed before ``pw``)."""
    return sorted({*command_secrets(command), *environ_secrets(environ)}, key=len, reverse=True)
