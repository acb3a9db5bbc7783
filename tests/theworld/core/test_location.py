"""theworld.core.location: a string parsed once into a local path, a URL, a hub id or `tiny`; a URL that names no
object is one line naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from theworld.core import location
from theworld.core.errors import UserError


@pytest.mark.parametrize(
    ("text", "scheme", "bucket", "key"),
    [
        ("s3://theworld-test/caches/a", "s3", "theworld-test", "caches/a"),
        ("s3://theworld-test/caches/a/", "s3", "theworld-test", "caches/a"),
        ("s3://theworld-test", "s3", "theworld-test", ""),
        ("gs://my_bucket.v2/x", "gs", "my_bucket.v2", "x"),
        ("https://example.org/data/cache", "https", "example.org", "data/cache"),
        ("hf://datasets/user/name/cache", "hf", "datasets", "user/name/cache"),
        ("S3://theworld-test/k", "s3", "theworld-test", "k"),
    ],
)
def test_a_url_is_parsed_into_scheme_bucket_and_key(text, scheme, bucket, key):
    where = location.place(text)
    assert isinstance(where, location.Remote)
    assert (where.scheme, where.bucket, where.key) == (scheme, bucket, key)
    assert where.url == text.rstrip("/") and str(where) == where.url


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("s3://", "no bucket name after s3://"),
        ("s3:///", "no bucket name after s3://"),
        ("s3:///key", "no bucket name after s3://"),
        ("https://", "no host name after https://"),
        ("s3://theworld-test//c", "an empty path segment (//) after bucket theworld-test"),
        ("gs://theworld-test/a//b", "an empty path segment (//)"),
        ("s3://Bad_Bucket/x", "'Bad_Bucket' is not a valid s3 bucket name"),
        ("s3://ab/x", "'ab' is not a valid s3 bucket name"),
        ("s3://a..b/x", "'a..b' is not a valid s3 bucket name"),
    ],
)
def test_a_url_that_names_no_object_is_one_line_naming_the_problem(text, words):
    with pytest.raises(UserError) as e:
        location.place(text, "config key 'cache_dir':")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"config key 'cache_dir': {text}"), message
    assert words in message, message


def test_a_local_path_stays_a_path(tmp_path):
    for text in (str(tmp_path / "c"), "cache/latents", "relative", "user/name"):
        where = location.place(text)
        assert where == location.Local(Path(text)) and str(where) == text


def test_a_model_spec_is_tiny_a_folder_or_a_hub_id(tmp_path, monkeypatch):
    assert location.model("tiny") == location.Tiny() and location.is_tiny("tiny") and not location.is_tiny("Tiny")
    assert location.model("google/gemma-3-4b-it") == location.HubId("google/gemma-3-4b-it", None)
    assert location.model("user/name@refs/pr/1") == location.HubId("user/name", "refs/pr/1")
    assert str(location.model("user/name@v1")) == "user/name@v1"
    (tmp_path / "user" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert location.model("user/name") == location.Local(Path("user/name"))  # a folder here wins over a hub id
    for not_an_id in ("runs/stage1/final", "/abs/path", "name", "./x/y", "../a/b", "a/b c", "a/b/"):
        assert location.model(not_an_id) == location.Local(Path(not_an_id)), not_an_id


def test_hub_ids_and_revisions_only():
    assert location.hub_id("user/name") == location.HubId("user/name", None)
    assert location.hub_id("user/name@v1.0") == location.HubId("user/name", "v1.0")
    for not_an_id in ("runs/stage1/final", "/abs/path", "name", "./x/y", "../a/b", "a/b c", "a/../b"):
        assert location.hub_id(not_an_id) is None, not_an_id


def test_a_config_path_key_that_is_a_bad_url_is_refused_before_anything_loads():
    from theworld.core.config import require_path

    with pytest.raises(UserError, match=r"^config key 'cache_dir': s3:// : no bucket|^config key 'cache_dir': s3://:"):
        require_path("cache_dir", "s3://")
    require_path("cache_dir", "s3://theworld-test/c")  # a valid URL: its bucket is checked when the run starts


def test_a_cache_at_a_url_that_names_no_object_is_one_line_where_it_is_opened(tmp_path):
    from theworld.cache_format import storage

    settings = storage.Settings(local_dir=str(tmp_path))
    for text, words in (("s3://", "no bucket name"), ("s3:///", "no bucket name"), ("s3://bkt-a//c", "empty path")):
        with pytest.raises(UserError, match=words):
            storage.RemoteCache(text, settings)
    assert storage.RemoteCache("s3://bkt-a/c/", settings).url == "s3://bkt-a/c"
