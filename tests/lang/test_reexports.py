"""`import plait as pl` is the language: every name of plait.lang is plait.<name>, loaded lazily."""

from __future__ import annotations

import subprocess
import sys

import plait
import plait.lang


def test_every_lang_name_is_a_top_level_name():
    for name in plait.lang.__all__:
        assert getattr(plait, name) is getattr(plait.lang, name), name
    assert plait._LANG_NAMES == set(plait.lang.__all__)
    assert set(plait.lang.__all__) <= set(plait.__all__) and set(plait.__all__) <= set(dir(plait))


def test_runtime_is_the_lang_runtime_and_engine_stays():
    from plait.engine import Engine
    from plait.lang.backends.runtime_endpoint import Runtime

    assert plait.Runtime is Runtime  # a server process (with .url) that is also a backend
    assert plait.Engine is Engine
    assert not hasattr(plait, "no_such_name")


def test_import_plait_stays_light():
    code = (
        "import sys, plait; "
        "heavy = [m for m in ('torch', 'plait.lang', 'plait.engine', 'plait.server', "
        "'plait.tokenizer') if m in sys.modules]; "
        "assert not heavy, heavy; "
        "plait.gen; assert 'plait.lang' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
