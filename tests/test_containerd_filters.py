"""containerd's filter language (prefetch.containerd.filters): matching and syntax errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from prefetch.containerd.errors import InvalidArgumentError
from prefetch.containerd.filters import Selector, parse, snapshot_adaptor
from prefetch.containerd.metadata import Kind

REF = "sha256:" + "12" * 32
PARENT = "default/3/sha256:" + "ab" * 32


@dataclass
class Info:
    name: str
    parent: str = ""
    kind: object = Kind.COMMITTED
    labels: dict[str, str] = field(default_factory=dict)


INFOS = [
    Info("base", labels={"containerd.io/snapshot.ref": "sha256:0", "team": "ml"}),
    Info(
        PARENT.replace("3", "4"),
        parent="base",
        labels={"containerd.io/snapshot.ref": REF, "a.b": "dotted"},
    ),
    Info("layer2", parent=PARENT, labels={"containerd.io/snapshot.ref": REF, "team": ""}),
    Info("work", parent="layer2", kind=Kind.ACTIVE, labels={"note": 'say "hi"\n'}),
    Info("ro", parent="layer2", kind="view"),
]


def names(*filters: str) -> list[str]:
    f = parse(list(filters))
    return [i.name for i in INFOS if f.match(snapshot_adaptor(i))]


def test_no_filters_and_empty_string_match_everything():
    assert names() == [i.name for i in INFOS]
    assert names("") == [i.name for i in INFOS]
    assert names("", "name==nothing") == [i.name for i in INFOS]


def test_equality_and_inequality():
    assert names("name==layer2") == ["layer2"]
    assert names("kind==active") == ["work"]
    assert names("kind==view") == ["ro"]
    assert names("kind!=committed") == ["work", "ro"]
    assert names("parent==base") == [INFOS[1].name]
    # != compares the empty value of an absent field, as containerd does
    assert names("labels.team!=ml") == [i.name for i in INFOS[1:]]


def test_presence():
    assert names("parent") == [i.name for i in INFOS]  # present, if empty, as in containerd
    assert names('parent==""') == ["base"]  # the handshake's filter for a first layer
    assert names("labels.team") == ["base", "layer2"]  # an empty label is present
    assert names("labels.nothing") == []
    assert names("bogus") == []


def test_regex_search():
    assert names("name~=^la") == ["layer2"]
    assert names("name~=[0-9]$") == ["layer2"]
    assert names("name~=/^(base|work)$/") == ["base", "work"]  # "|" inside /.../ is regex
    assert names("name~=|^r.$|") == ["ro"]
    assert names(r"parent~=/default\/3/") == ["layer2"]
    assert names('labels."containerd.io/snapshot.ref"~="^sha256:1"') == [INFOS[1].name, "layer2"]


def test_and_within_a_string_or_across_strings():
    assert names('kind==committed,parent!=""') == [INFOS[1].name, "layer2"]
    assert names('kind==committed,parent!="",labels.team') == ["layer2"]
    assert names("name==base", "name==ro") == ["base", "ro"]
    assert names("name==base,kind==view", "name==ro") == ["ro"]


def test_quoted_fields_and_values_with_escapes():
    assert names('labels."note"=="say \\"hi\\"\\n"') == ["work"]
    assert names('"name"=="\\x62\\u0061\\U00000073\\145"') == ["base"]  # b a s e
    assert parse(['name=="tab\\there"']).alternatives[0][0].value == "tab\there"
    assert parse(['name=="\\u725b"']).alternatives[0][0].value == "牛"
    assert parse(['name=="a,b c"']).alternatives[0][0].value == "a,b c"


def test_label_keys_with_dots_and_slashes():
    # the rest of the fieldpath is joined with "." for labels
    assert names("labels.a.b==dotted") == [INFOS[1].name]
    assert names('labels."a.b"==dotted') == [INFOS[1].name]
    assert names('labels."containerd.io/snapshot.ref"==sha256:0') == ["base"]
    assert names('labels."containerd.io/snapshot".ref==sha256:0') == ["base"]


def test_the_filter_containerd_sends_a_proxy_snapshotter():
    text = f'labels."containerd.io/snapshot.ref"=={REF},parent=="{PARENT}"'
    assert names(text) == ["layer2"]
    ((sel_ref, sel_parent),) = parse([text]).alternatives
    assert sel_ref == Selector(("labels", "containerd.io/snapshot.ref"), "==", REF)
    assert sel_parent == Selector(("parent",), "==", PARENT)
    # the same, unquoted: a bare value may hold ":" and "/"
    assert names(f'labels."containerd.io/snapshot.ref"=={REF},parent=={PARENT}') == ["layer2"]


def test_bare_values_and_whitespace():
    sel = parse(["name==a:b/c@d-e_f.g+h=i~j!"]).alternatives[0][0]
    assert sel.value == "a:b/c@d-e_f.g+h=i~j!"
    assert parse(["  name == x , kind==view  "]).alternatives[0] == (
        Selector(("name",), "==", "x"),
        Selector(("kind",), "==", "view"),
    )
    assert parse(["some-field_1"]).alternatives[0] == (Selector(("some-field_1",)),)


def test_adaptor_kind_forms():
    for kind in (3, Kind.COMMITTED, "committed", "COMMITTED"):
        assert snapshot_adaptor(Info("x", kind=kind))(["kind"]) == ("committed", True)
    assert snapshot_adaptor(Info("x", kind=0))(["kind"]) == ("", False)
    assert snapshot_adaptor(Info("x"))([]) == ("", False)
    assert snapshot_adaptor(Info("x"))(["labels"]) == ("", False)


@pytest.mark.parametrize(
    "text, pos, message",
    [
        ('name=="abc', 6, "quoted literal not terminated"),
        ('labels."a\nb"==x', 7, "quoted literal not terminated"),
        ("name==", 6, "expected a value"),
        ("name==,kind==view", 6, "expected a value"),
        ("name=x", 4, "unsupported operator '='"),
        ("name===x", 4, "unsupported operator '==='"),
        ("name<x", 4, "expected an operator"),
        ("labels.containerd.io/key==v", 20, "expected an operator"),
        ("name==a b", 8, "unexpected input 'b'"),
        ("name==a,", 8, "expected a field"),
        (",name==a", 0, "expected a field"),
        ("labels.==x", 7, "expected a field"),
        ('name=="\\q"', 7, "illegal escape sequence \\q"),
        ('name=="\\xZZ"', 7, "illegal escape \\x"),
        ('name=="\\400"', 7, "illegal octal escape"),
        ('name=="\\/"', 7, "illegal escape sequence \\/"),
        ("name==/x/", 6, "quotes only a ~= regular expression"),
        ("/name/==x", 0, "quotes only a ~= regular expression"),
        ("name~=[", 6, "bad regular expression"),
        ("name~=/\\d/", 7, "illegal escape sequence \\d"),  # as in containerd: write \\d
        ("name==.x", 6, "expected a value"),
        ("name==x\x00", 7, "unexpected input"),
    ],
)
def test_syntax_errors_name_the_string_and_position(text, pos, message):
    with pytest.raises(InvalidArgumentError) as err:
        parse(["name==ok", text])
    msg = str(err.value)
    assert repr(text) in msg
    assert message in msg
    assert f"at position {pos} " in msg
    assert err.value.code.name == "INVALID_ARGUMENT"


def test_error_message_marks_the_character():
    with pytest.raises(InvalidArgumentError, match=r"\[name >\|<\|< x\]"):
        parse(["name<x"])
    with pytest.raises(InvalidArgumentError, match=r"\(end of input\)"):
        parse(["name=="])


def test_a_single_string_is_refused():
    with pytest.raises(TypeError):
        parse("name==x")  # type: ignore[arg-type]
