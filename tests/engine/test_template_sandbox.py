"""Chat templates are code from the model folder: rendered in a sandbox with limits on time and size
(engine.decode.chat_template), so a hostile template is one PromptError within a couple of seconds and without a big
allocation, while ordinary templates render exactly as plain Jinja2 renders them.

The hostile templates run in a child process under an address-space limit (RLIMIT_AS): if a guard is missing, the
allocation fails there with a MemoryError (and the test fails) instead of filling this machine's memory.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fixtures_tiny import copy_model, tiny_clover_dir  # noqa: F401
from jinja2.sandbox import ImmutableSandboxedEnvironment
from worker_proc import WorkerProc

from clover_desk.engine.decode.limits import TEMPLATE_MAX_SOURCE_CHARS, TEMPLATE_TIMEOUT_S
from clover_desk.engine.decode.tokenizer import CloverTokenizer, shipped_file, train_tiny_tokenizer
from clover_desk.engine.errors import ConfigError, PromptError

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "hello " * 100}]
CHILD_MEMORY = 2 << 30  # bytes of address space for the child that renders the hostile templates
CHILD_CPU_S = 60  # and CPU seconds: a missing guard (one C call computing 10 ** 10**9) fails the test, not hangs it


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(out, vocab_size=600)
    return out


def _with_template(tok_dir: Path, folder: Path, template: str) -> CloverTokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return CloverTokenizer.from_dir(folder)


# ---- hostile templates (in a memory-limited child) -------------------------------------------------------------------

SLOW = {
    "nested-empty-loops": "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",
    "nested-loops-with-work": "{% for i in range(10**5) %}{% for j in range(10**5) %}{% if (i * j) % 7 == 8 %}x"
                              "{% endif %}{% endfor %}{% endfor %}",
    # no call, operator or output anywhere in the loops: only the line trace sees them
    "loops-over-a-list": "{% set r = range(10**5) | list %}{% for i in r %}{% for j in r %}{% for k in r %}"
                         "{% endfor %}{% endfor %}{% endfor %}",
}
BIG = {
    "str-times": "{{ 'x' * 10**10 }}",
    "list-times": "{{ [0] * 10**10 }}",
    "times-str": "{{ 10**10 * 'x' }}",
    "list-of-a-big-string-times": "{% set b = 'x' * 100000 %}{{ ([b] * 100000) | length }}",
    "center-filter": "{{ 'x' | center(10**10) }}",
    "ljust-method": "{{ 'x'.ljust(10**10) }}",
    "zfill-method": "{{ '1'.zfill(10**10) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(10**8) }}",
    "printf-width": "{{ '%10000000000s' % 'x' }}",
    "printf-star-width": "{{ '%*s' % (10**10, 'x') }}",
    "format-filter": "{{ '%10000000000d' | format(1) }}",
    "str-format-width": "{{ '{:>10000000000}'.format('x') }}",
    "str-format-nested-width": "{{ '{:>{}}'.format('x', 10**10) }}",
    "replace-filter": "{{ ('x' * 100000) | replace('', 'y' * 100000) }}",
    "replace-method": "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "join-filter-separator": "{{ range(100000) | join('x' * 100000) }}",
    "join-method": "{{ ('x' * 100000).join(['a'] * 100000) }}",
    "indent-filter": "{{ ('a\n' * 100000) | indent(100000) }}",
    "concat-doubling": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "plus-doubling": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s | length }}",
    "list-growing": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 100000] %}"
                    "{% endfor %}{{ ns.l | length }}",
    "block-set-doubling": "{% set a0 %}{{ 'x' * 1000 }}{% endset %}"
                          + "".join(f"{{% set a{i + 1} %}}{{{{ a{i} }}}}{{{{ a{i} }}}}{{% endset %}}" for i in range(40))
                          + "{{ a40 | length }}",
    "macro-doubling": "{% macro twice(n) %}{% if n %}{{ twice(n - 1) }}{{ twice(n - 1) }}{% else %}xxxxxxxx"
                      "{% endif %}{% endmacro %}{{ twice(40) | length }}",
    "output-loop": "{% for i in range(10**5) %}{% for j in range(10**5) %}{{ messages[0].content }}{% endfor %}"
                   "{% endfor %}",
    "literal-loop": "{% for i in range(10**5) %}{% for j in range(10**5) %}" + "x" * 100 + "{% endfor %}{% endfor %}",
    "sum-of-lists": "{{ ([[1]] * 100000) | sum(start=[]) | length }}",
    "batch-fill": "{{ [1] | batch(10**10, 0) | list | length }}",
    "tojson-indent": "{{ messages | tojson(indent=10**9) }}",
    "int-power": "{{ 10 ** (10 ** 9) }}",
    "int-squaring": "{% set ns = namespace(n=10**1000) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                    "{% endfor %}{{ ns.n > 0 }}",
}
# operations whose result can be many times what they are given (issue 31): each is charged for what it builds, so
# the refusal names it (not the '{{ }}' or output check that would only see the result once it is built)
AMPLIFY = {
    "strftime-width": ("{{ strftime_now('%1500Y' * 150000) }}", "strftime_now: the date format specifier '%1500Y'"),
    "strftime-flag": ("{{ strftime_now('%_10d') }}", "'%_10d' has a width or flag"),
    "strftime-c": ("{{ strftime_now('%c' * 100000) | length }}", "strftime_now()"),
    "upper-filter": ("{{ ('\u00df' * 400000) | upper }}", "the upper filter"),
    "upper-method": ("{{ ('\u00df' * 400000).upper() | length }}", "str.upper()"),
    "title-filter": ("{{ ('\u0149' * 400000) | title | length }}", "the title filter"),
    "lower-method": ("{{ ('\u0130' * 400000).lower() | length }}", "str.lower()"),
    "xmlattr": ("{{ {'a': '\"' * 200000} | xmlattr }}", "the xmlattr filter"),
    "escape": ("{{ ('\"' * 200000) | escape | length }}", "the escape filter"),
    "forceescape": ("{{ ('&' * 200000) | forceescape | length }}", "the forceescape filter"),
    "urlencode": ("{{ ('\U0001F600' * 100000) | urlencode | length }}", "the urlencode filter"),
    "urlize": ("{{ ('a.co ' * 150000) | urlize | length }}", "the urlize filter"),
    "split-method": ("{{ ('a ' * 400000).split() | length }}", "str.split()"),
    "splitlines-method": ("{{ ('\\n' * 400000).splitlines() | length }}", "str.splitlines()"),
    "list-of-a-string": ("{{ ('\u4e00' * 500000) | list | length }}", "the list filter"),
    "translate-method": ("{{ ('x' * 100000).translate({120: 'y' * 1000}) | length }}", "str.translate()"),
    "encode-method": ("{{ ('\\x00' * 300000).encode('unicode_escape') | length }}", "str.encode()"),
    "tojson-control": ("{{ ('\\x01' * 300000) | tojson | length }}", "tojson"),
    "string-filter": ("{{ ['\\x01' * 300000] | string | length }}", "the string filter"),
    "pprint-filter": ("{{ ['\\x01' * 300000] | pprint | length }}", "the pprint filter"),
}
CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from clover_desk.engine.errors import PromptError
    from clover_desk.engine.decode.tokenizer import CloverTokenizer
    cases, folder, messages = json.loads(sys.stdin.read())
    results = {}
    for name, template in cases.items():
        Path(folder, "chat_template.jinja").write_text(template, encoding="utf-8")
        tok = CloverTokenizer.from_dir(folder)
        start = time.monotonic()
        try:
            text = tok.apply_chat_template(messages)
            results[name] = ["rendered", len(text), time.monotonic() - start]
        except PromptError as exc:
            results[name] = ["PromptError", str(exc), time.monotonic() - start]
    # VmHWM: this program's own peak (ru_maxrss would also count the pytest process the child was forked from,
    # before exec)
    hwm = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:")]
    results["peak_rss_kib"] = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(results))
""")


def _render_in_child(tok_dir: Path, folder: Path, cases: dict[str, str]) -> dict[str, list]:
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())

    def limit_child() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
        resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_S, CHILD_CPU_S))

    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps([cases, str(folder), USER]), text=True,
                          capture_output=True, cwd=ROOT, preexec_fn=limit_child, timeout=3 * CHILD_CPU_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_template_that_runs_forever_is_stopped_within_the_time_limit(tok_dir: Path, tmp_path: Path) -> None:
    results = _render_in_child(tok_dir, tmp_path / "m", SLOW)
    for name in SLOW:
        kind, message, elapsed = results[name]
        assert kind == "PromptError", (name, results[name])
        assert message == (f"{tmp_path / 'm' / 'chat_template.jinja'}: the chat template was stopped: it ran longer "
                           f"than {TEMPLATE_TIMEOUT_S:g} s, the most a chat template may take"), name
        assert TEMPLATE_TIMEOUT_S <= elapsed < TEMPLATE_TIMEOUT_S + 20, (name, elapsed)  # bounded, load allowing


def test_a_template_that_builds_too_much_is_refused_before_it_allocates(tok_dir: Path, tmp_path: Path) -> None:
    results = _render_in_child(tok_dir, tmp_path / "m", BIG)
    failures = []
    for name in BIG:
        kind, message, elapsed = results[name]
        source = str(tmp_path / "m" / "chat_template.jinja")
        # refused by the size check (the reason names no running time), not by the deadline: the clock is not
        # asserted, since a loaded machine may take its time to get there
        if not (kind == "PromptError" and message.startswith(f"{source}: the chat template was stopped: ")
                and "\n" not in message and "ran longer than" not in message):
            failures.append((name, kind, str(message)[:200], round(elapsed, 2)))
    assert not failures, failures
    assert results["peak_rss_kib"] < 512 * 1024  # nothing big was ever allocated


def test_each_amplifier_is_charged_for_what_it_builds(tok_dir: Path, tmp_path: Path) -> None:
    results = _render_in_child(tok_dir, tmp_path / "m", {name: template for name, (template, _) in AMPLIFY.items()})
    source = str(tmp_path / "m" / "chat_template.jinja")
    failures = []
    for name, (_template, names) in AMPLIFY.items():
        kind, message, elapsed = results[name]
        if not (kind == "PromptError" and message.startswith(f"{source}: the chat template was stopped: ")
                and names in message and "\n" not in message and elapsed < TEMPLATE_TIMEOUT_S + 20):
            failures.append((name, kind, str(message)[:300], round(elapsed, 2)))
    assert not failures, failures
    assert results["peak_rss_kib"] < 512 * 1024  # nothing big was ever allocated


# ---- ordinary templates render exactly as plain Jinja2 renders them ------------------------------------------------


def _plain(template: str) -> ImmutableSandboxedEnvironment:
    """The environment templates were rendered in before the limits: the reference output."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


FEATURES = (
    "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% set ns.s = ns.s ~ m.role ~ ':' %}{% endfor %}{{ ns.n }}|{{ ns.s }}|"
    "{{ '%s-%03d' % ('a', 7) }}|{{ '%5.1f' | format(3.14159) }}|{{ '{}!{:>4}'.format('x', 'y') }}|"
    "{{ 'ab' * 3 }}|{{ 2 * 'c' }}|{{ [1, 2] + [3] }}|{{ 'p' + 'q' }}|{{ 2 ** 10 }}|{{ 7 * 6 }}|"
    "{{ 'x' | center(9) }}|{{ 'y'.ljust(4) }}.|{{ '7'.zfill(3) }}|{{ 'a\tb'.expandtabs(4) }}|"
    "{{ 'a,b,c'.replace(',', ';') }}|{{ 'aXbX' | replace('X', '--', 1) }}|{{ range(5) | join(',') }}|"
    "{{ '-'.join(['u', 'v']) }}|{{ 'l1\nl2' | indent(2, true) }}|{{ 'one two three' | wordwrap(5) }}|"
    "{{ [[1], [2, 3]] | sum(start=[]) }}|{{ [1, 2, 3] | sum }}|{{ range(7) | batch(3, 0) | list }}|"
    "{{ messages[0] | tojson }}|{{ {'k': [1, {'z': 'é'}]} | tojson(indent=2) }}|{{ messages[0].content.split()[0] }}|"
    "{% for m in messages %}{% if loop.first %}{{ loop.length }}{% endif %}{% if loop.index > 1 %}{% break %}"
    "{% endif %}{% endfor %}|{{ messages }}|{{ (messages | map(attribute='role') | list) }}|"
    "{{ 'abc\u00df' | upper }}|{{ 'A B' | lower }}|{{ 'ab cd' | title }}|{{ 'ab' | capitalize }}|{{ 'Ab'.upper() }}"
    "{{ 'Ab'.lower() }}{{ 'ab'.title() }}{{ 'aB'.swapcase() }}{{ 'A'.casefold() }}|{{ 'a b\tc'.split() }}"
    "{{ 'a,b'.split(',') }}{{ 'a,b'.rsplit(',', 1) }}{{ 'a\nb'.splitlines() }}|{{ {'k': 'x\"<y'} | xmlattr }}|"
    "{{ 'a&b' | e }}{{ '<p>' | escape }}{{ 'q' | forceescape }}|{{ 'x y/\u00e9' | urlencode }}"
    "{{ {'a': 'b c'} | urlencode }}|{{ 'see a.co now' | urlize }}|{{ [1, 'a\x01'] | string }}|{{ [1, [2]] | pprint }}|"
    "{{ 'ab' | list }}{{ range(3) | list }}|{{ 'ab'.encode() | length }}|{{ 'abc'.translate({97: 'xy'}) }}|"
    "{{ 'x\x01\"' | tojson }}"
)


def test_strftime_now_renders_plain_directives(tok_dir: Path, tmp_path: Path) -> None:
    tok = _with_template(tok_dir, tmp_path / "m", "{{ strftime_now('%Y-%m-%d %H:%M:%S %A %d %b %c %%-%Ex %Oy') }}")
    text = tok.apply_chat_template(USER)
    assert text.startswith(time.strftime("%Y-")) and "%-" in text and len(text) < 120


def test_ordinary_templates_render_as_plain_jinja2_renders_them(tok_dir: Path, tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "Be brief. Grüße 你好"},
        {"role": "user", "content": "Weather in Lisbon?"},
        {"role": "assistant", "content": "", "reasoning_content": "one call",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}}}]},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for i, template in enumerate([shipped_file("chat_template.jinja"), FEATURES]):
        tok = _with_template(tok_dir, tmp_path / f"t{i}", template)
        for thinking in (True, False):
            want = _plain(template).render(messages=messages, tools=tools, add_generation_prompt=True,
                                           enable_thinking=thinking, bos_token="", eos_token="<|im_end|>")
            assert tok.apply_chat_template(messages, tools=tools, enable_thinking=thinking) == want


def test_a_long_conversation_renders_within_the_limits(tok_dir: Path, tmp_path: Path) -> None:
    """The budget grows with the input: 2,000 turns and a 4 MiB message render, and equal the plain render."""
    template = shipped_file("chat_template.jinja")
    messages = []
    for i in range(1000):
        messages += [{"role": "user", "content": f"question {i} " * 20},
                     {"role": "assistant", "content": "answer " * 30, "reasoning_content": "thought " * 10}]
    messages.append({"role": "user", "content": "z" * (4 << 20)})
    tok = _with_template(tok_dir, tmp_path / "t", template)
    start = time.monotonic()
    text = tok.apply_chat_template(messages)
    assert time.monotonic() - start < TEMPLATE_TIMEOUT_S
    assert text == _plain(template).render(messages=messages, tools=None, add_generation_prompt=True,
                                           enable_thinking=True, bos_token="", eos_token="<|im_end|>")


def test_render_errors_and_oversized_sources_are_one_line(tok_dir: Path, tmp_path: Path) -> None:
    for i, (template, needle) in enumerate([
        ("{{ range(10**9) | list }}", "chat template failed: OverflowError: Range too big"),
        ("{{ 1 / 0 }}", "chat template failed: ZeroDivisionError: division by zero"),
        ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "chat template failed: RecursionError"),
        ("{{ lipsum(10**9) }}", "chat template failed: 'lipsum' is undefined"),
        ("{{ ''.__class__.__mro__ }}", "chat template failed: access to attribute '__class__'"),
    ]):
        tok = _with_template(tok_dir, tmp_path / f"e{i}", template)
        with pytest.raises(PromptError) as err:
            tok.apply_chat_template(USER)
        assert str(err.value).startswith(needle) and "\n" not in str(err.value), str(err.value)
    nested = _with_template(tok_dir, tmp_path / "nested", "{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}")
    with pytest.raises(ConfigError, match=r"chat_template.jinja: chat template does not compile \(RecursionError"):
        nested.apply_chat_template(USER)
    too_long = f"chat_template.jinja: the chat template has {TEMPLATE_MAX_SOURCE_CHARS + 1:,}"
    with pytest.raises(ConfigError, match=too_long):
        _with_template(tok_dir, tmp_path / "big", "x" * (TEMPLATE_MAX_SOURCE_CHARS + 1))


def test_the_rendering_thread_gets_its_tracer_back(tok_dir: Path, tmp_path: Path) -> None:
    """The deadline is a trace function set only while rendering: a debugger's or coverage's tracer is restored,
    after a render that finished and after one that was stopped."""

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        _with_template(tok_dir, tmp_path / "ok", "{{ messages[0].content }}").apply_chat_template(USER)
        assert sys.gettrace() is tracer
        with pytest.raises(PromptError, match="stopped"):
            _with_template(tok_dir, tmp_path / "big", "{{ 'x' * 10**10 }}").apply_chat_template(USER)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)


def test_the_worker_reports_a_runaway_template_and_keeps_serving(
    tiny_clover_dir: Path, tmp_path: Path,  # noqa: F811
) -> None:
    """Through the real worker and the real engine: the request ends with one PromptError within a couple of
    seconds, and the next request (a raw prompt, no template) runs to its end."""
    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text(SLOW["nested-empty-loops"])
    w = WorkerProc()
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir=str(folder))
        w.expect_event("loaded")
        start = time.monotonic()
        w.send(cmd="generate", id="t", messages=USER, params={"max_new_tokens": 2})
        answer = w.expect(lambda r: r.get("id") == "t")
        assert time.monotonic() - start < TEMPLATE_TIMEOUT_S + 20
        assert (answer["event"], answer["kind"], answer["fatal"]) == ("error", "PromptError", False), answer
        assert f"ran longer than {TEMPLATE_TIMEOUT_S:g} s" in answer["message"]
        w.send(cmd="generate", id="raw", prompt="hello", raw=True, params={"max_new_tokens": 2, "mode": "ar"})
        assert w.expect(lambda r: r.get("id") == "raw" and r["event"] in ("finished", "error"))["event"] == "finished"
    finally:
        w.close()
