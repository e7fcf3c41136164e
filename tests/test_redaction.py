"""redaction.py: secrets found by what their names say, one rule for the config, fit, run and the
writers. Megatron-LM's, torchrun's and Megatron-Bridge's own options are walked: none is taken for a
secret unless it carries a credential."""

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_memlog.launch.fit.words import shown
from nemo_memlog.redaction import REDACTED, command_secrets, environ_secrets, launch_secrets, redact, secret_name

#: Options and fields that carry a credential, in the spellings users write them.
CREDENTIALS = (
    "HF_TOKEN", "--hf-token", "hf_token", "GITHUB_TOKEN", "auth_token", "apiKey", "WANDB_API_KEY",
    "--wandb-api-key", "--comet-api-key", "COMET_API_KEY", "logger.comet_api_key", "mlflow_password",
    "DB_PASSWD", "AWS_SECRET_ACCESS_KEY", "client_secret", "GOOGLE_APPLICATION_CREDENTIALS", "basic_auth",
    "private_key", "--token",
)  # fmt: skip
#: Names that hold a tokenizer, a vocabulary item or a count: never secrets.
NOT_CREDENTIALS = (
    "--tokenizer-type", "--tokenizer-model", "--max-tokens-to-oom", "--moe-token-dispatcher-type",
    "eos_token_id", "pad_token", "--fim-prefix-token", "author", "tokenizer", "--linear-key-head-dim",
    "num_tokens", "monkey", "authors_file",
)  # fmt: skip


def test_names_are_judged_by_their_words():
    assert [name for name in CREDENTIALS if not secret_name(name)] == []
    assert [name for name in NOT_CREDENTIALS if secret_name(name)] == []


def test_a_megatron_lm_command_is_shown_whole_and_its_credentials_are_not():
    command = ["torchrun", "pretrain_gpt.py", "--tokenizer-type", "GPT2BPETokenizer", "--tokenizer-model", "/m/tok"]
    command += ["--max-tokens-to-oom", "12000", "--hf-token", "hf_abcdef", "--comet-api-key=COMETKEY1"]
    command += ["bash", "-c", "WANDB_API_KEY=KEY789 python t.py --micro-batch-size 4 --hf-token HFTOK2 --x 1"]
    assert sorted(command_secrets(command)) == ["COMETKEY1", "HFTOK2", "KEY789", "hf_abcdef"]
    text = shown(command)
    assert "--tokenizer-type GPT2BPETokenizer --tokenizer-model /m/tok --max-tokens-to-oom 12000" in text
    assert f"--hf-token {REDACTED}" in text and f"--comet-api-key={REDACTED}" in text
    assert "hf_abcdef" not in text and "KEY789" not in text and "HFTOK2" not in text


def test_one_rule_for_a_config_the_environment_and_a_launch():
    params, found = redact({"tokenizer_type": "GPT2BPETokenizer", "hf_token": "hf_x1234", "tokenizer_model": "/t"})
    assert params == {"tokenizer_type": "GPT2BPETokenizer", "hf_token": REDACTED, "tokenizer_model": "/t"}
    assert found == ["hf_x1234"]
    environ = {"HF_TOKEN": "hf_env123", "TOKENIZERS_PARALLELISM": "false", "MAX_TOKENS": "40960", "HOME": "/r"}
    assert environ_secrets(environ) == ["hf_env123"]
    assert launch_secrets(["t", "--hf-token", "hf_cmd123456"], environ) == ["hf_cmd123456", "hf_env123"]


_MEGATRON_OPTIONS = r"""
import argparse, json, sys
from nemo_memlog.testing.bridge_env import typing_override
from nemo_memlog.testing.megatron.lm_job import hide_modelopt
hide_modelopt()
typing_override()
from megatron.training import arguments
from torch.distributed.run import get_args_parser
parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
parser = arguments.add_megatron_arguments(parser)
json.dump({
    "megatron": [[action.dest, *action.option_strings] for action in parser._actions],
    "torchrun": [[action.dest, *action.option_strings] for action in get_args_parser()._actions],
}, sys.stdout)
"""


@pytest.mark.processes
def test_no_option_of_megatron_lm_torchrun_or_bridge_is_taken_for_a_secret():
    """Megatron-LM's parser built as its parse_args builds it (add_megatron_arguments), torchrun's
    (get_args_parser), in a process of their own (Megatron's import is the process's); Megatron-
    Bridge's command-line fields (its training config's dataclass fields, read from its source).
    The old substring rule redacted 31 of Megatron-LM's 808 options (--tokenizer-type among them)."""
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("this megatron-core ships no Megatron-LM (megatron.training)")
    done = subprocess.run([sys.executable, "-c", _MEGATRON_OPTIONS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parsers = json.loads(done.stdout)
    megatron = [name for names in parsers["megatron"] for name in names]
    torchrun = [name for names in parsers["torchrun"] for name in names]
    assert "--tokenizer-type" in megatron and "--max-tokens-to-oom" in megatron and len(megatron) > 1000
    assert "--nproc-per-node" in torchrun or "--nproc_per_node" in torchrun
    assert [name for name in megatron + torchrun if secret_name(name)] == []
    bridge = _bridge_fields()
    assert "micro_batch_size" in bridge and "tokenizer_model" in bridge and len(bridge) > 100
    assert [name for name in bridge if secret_name(name)] == ["comet_api_key"]  # its one credential


def _bridge_fields() -> list[str]:
    """Every annotated field of a class in Megatron-Bridge's training package and megatron-core's
    training config (its ConfigContainer and the configs in it, some of them megatron-core's: the
    ``section.field=value`` overrides of its recipes' command lines)."""
    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.origin is not None
    megatron = Path(spec.origin).parents[1]
    if not (megatron / "bridge" / "training").is_dir():
        pytest.skip("no Megatron-Bridge beside megatron-core")
    fields = set()
    sources = [*(megatron / "bridge" / "training").rglob("*.py"), *(megatron / "training" / "config").rglob("*.py")]
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                        fields.add(statement.target.id)
    return sorted(fields)
