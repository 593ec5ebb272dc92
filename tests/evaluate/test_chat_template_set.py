"""05's built chat-template set (evaluate.prompt_sets.NAME: {built: chat_template, template?}): the held-out prompts,
each request carrying another chat template than the target's, measured beside the held-out set. On the fake vLLM
server of test_evaluate.py; the real vLLM renders it in tests/pipeline/test_e2e.py (the demo config has the set)."""

from __future__ import annotations

import io
import json

import pytest

from common.core.config import config_from_dict
from common.core.errors import ConfigError, PipelineError
from common.core.run_folder import HELD_OUT
from common.evaluate.serve import target_server as real_target_server  # before run_env swaps it for a fake
from common.evaluate import stage as evaluate
from common.evaluate.built_sets import CHANGED_TEMPLATE
from common.evaluate.prompt_sets import context_check, load_prompt_set
from common.serving import vllm_server
from tests.evaluate.test_evaluate import run_env, serve_fakes  # noqa: F401 (run_env: a fixture)
from tests.helpers import FakeVllm


def with_sets(cfg, prompt_sets: dict):
    tree = cfg.to_dict()
    return config_from_dict({**tree, "evaluate": {**tree["evaluate"], "prompt_sets": prompt_sets}})


def test_held_out_questions_are_sent_under_another_template_and_counted_as_it_renders(run_env, capsys):
    cfg = with_sets(run_env.cfg, {"tpl": {"built": "chat_template"}})
    s = load_prompt_set(cfg, "tpl")
    held_out = load_prompt_set(cfg, HELD_OUT)
    assert [p["id"] for p in s.prompts] == [f"tpl-{p['id']}" for p in held_out.prompts]
    assert [p["messages"] for p in s.prompts] == [p["messages"] for p in held_out.prompts]
    assert {p["chat_template"] for p in s.prompts} == {CHANGED_TEMPLATE}
    assert s.built["kind"] == "chat_template" and s.built["template"] == "built-in"

    # counted as the changed template renders the prompt, which is not how the target's own does
    check = context_check(cfg)
    rendered = check.tokenizer.apply_chat_template(s.prompts[1]["messages"], chat_template=CHANGED_TEMPLATE,
                                                  tokenize=False, add_generation_prompt=True)
    assert rendered == "### System:\nbe brief\n\n### User:\nquestion 3\n\n### Assistant:\n"
    own = check.length(s.prompts[1]["messages"])
    changed = check.length(s.prompts[1]["messages"], CHANGED_TEMPLATE)
    assert changed == len(check.tokenizer(rendered, add_special_tokens=False)["input_ids"]) != own

    assert evaluate.run_stage(cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    part = report["prompt_sets"]["tpl"]
    assert part["num_prompts"] == 4 and part["built"]["template"] == "built-in"
    # every request of the set carries the template, on both servers; the held-out set's carry none
    sent = [b for started in run_env.started for b in started["server"].requests if b["max_tokens"] == 64]  # no warm-up
    templated = [b for b in sent if "chat_template" in b]
    assert {b["chat_template"] for b in templated} == {CHANGED_TEMPLATE}
    assert len(templated) == 2 * 4 and len(sent) == 2 * 2 * 4  # the set and the held-out one, with and without the draft
    assert "prompt set tpl (4 prompts)" in capsys.readouterr().out


def test_a_configured_template_is_carried_by_every_prompt_and_the_servers_trust_request_templates(run_env, monkeypatch):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    cfg = with_sets(run_env.cfg, {"tpl": {"built": "chat_template", "template": template}})
    s = load_prompt_set(cfg, "tpl")
    assert {p["chat_template"] for p in s.prompts} == {template} and s.built["template"] == "config"
    assert cfg.evaluate.sends_chat_templates() and not run_env.cfg.evaluate.sends_chat_templates()

    # the pipeline's servers (05's, and run_pipeline.py's for 01b) take a request's template only with the flag;
    # a config without the set does not open that door
    started = []
    monkeypatch.setattr(vllm_server.VllmServer, "from_config",
                        classmethod(lambda cls, cfg_, **kwargs: started.append(kwargs["extra_args"])))
    real_target_server(cfg)
    real_target_server(run_env.cfg)
    assert "--trust-request-chat-template" in started[0] and "--trust-request-chat-template" not in started[1]


def test_bad_templates_are_one_config_error(run_env):
    with pytest.raises(ConfigError, match=r"prompt_sets.tpl.template' is not a valid Jinja template \(line 1"):
        with_sets(run_env.cfg, {"tpl": {"built": "chat_template", "template": "{% for m in messages %}"}})
    with pytest.raises(ConfigError, match=r"prompt_sets.tpl.template' must be a chat template"):
        with_sets(run_env.cfg, {"tpl": {"built": "chat_template", "template": ""}})
    with pytest.raises(ConfigError, match=r"a built chat_template set takes built, template, got buckets"):
        with_sets(run_env.cfg, {"tpl": {"built": "chat_template", "buckets": [512]}})
    own = context_check(run_env.cfg).tokenizer.chat_template
    cfg = with_sets(run_env.cfg, {"tpl": {"built": "chat_template", "template": own}})
    with pytest.raises(ConfigError, match=r"is the target's own chat template"):
        load_prompt_set(cfg, "tpl")


class UntrustingVllm(FakeVllm):
    """A server started without --trust-request-chat-template: vLLM 0.32's 400 for a request that carries a template."""

    def handle(self, request, method):
        if method == "POST":
            body = json.loads(request.rfile.read(int(request.headers["Content-Length"])))
            if "chat_template" in body:
                self.reply(request, 400, {"error": {"message": "Chat template is passed with request, but "
                           "--trust-request-chat-template is not set. Refused request with untrusted chat template.",
                           "type": "BadRequestError", "code": 400}})
                return
            request.rfile = io.BytesIO(json.dumps(body).encode())
            request.headers.replace_header("Content-Length", str(len(request.rfile.getvalue())))
        super().handle(request, method)


def test_a_server_that_does_not_trust_request_templates_is_one_line_saying_so(run_env, monkeypatch):
    cfg = with_sets(run_env.cfg, {"tpl": {"built": "chat_template"}})
    serve_fakes(run_env, monkeypatch, lambda speculative: UntrustingVllm(with_draft=speculative is not None))
    with pytest.raises(PipelineError) as e:
        evaluate.run_stage(cfg)
    said = str(e.value)
    assert "request for prompt tpl-p1" in said and "Refused request with untrusted chat template" in said, said
    assert "start your vLLM server with --trust-request-chat-template, or leave --base-url out" in said, said
    assert "\n" not in said
