"""What image prompts do not support yet is refused before anything starts, naming the key and the
fix (``offstep.data.vision_refusals``, asked by ``offstep.launch.validate`` for ``preset=tiny_vl``)."""

from __future__ import annotations

import pytest

from offstep.data.vision_refusals import images_expected
from offstep.launch.loader import load_config
from offstep.launch.validate import problems


def test_the_preset_is_valid_and_expects_images():
    cfg = load_config(["preset=tiny_vl"])
    assert cfg.preset == "tiny_vl" and images_expected(cfg) and problems(cfg) == []
    assert problems(load_config(["preset=tiny_vl", "pipeline.mode=fully_async"])) == []
    assert not images_expected(load_config(["preset=tiny"]))
    assert images_expected(load_config(["preset=tiny", "data.task=shapes"]))


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.engine=vllm", "rollout.engine=vllm"),
        ("algorithm.adv_estimator=remax", "algorithm.adv_estimator=remax"),
    ],
)
def test_what_images_do_not_support_yet_is_refused(override, key):
    found = [p for p in problems(load_config(["preset=tiny_vl", override])) if "image prompts" in p]
    assert len(found) == 1 and found[0].startswith(key) and "Fix:" in found[0], found
    # the same key without images is not refused for images
    assert not [p for p in problems(load_config(["preset=tiny", override])) if "image prompts" in p]


def test_rows_with_images_are_checked_once_read():
    """A vision-language model folder of one's own with one's own data: the rows tell."""
    from offstep.config.choices import TOOL_AGENT
    from offstep.data.dataset import PromptRecord
    from offstep.errors import ConfigError
    from offstep.pipeline.inputs import _check_image_run

    row = PromptRecord(0, "geo", [{"role": "user", "content": "<image>x"}], "1", images=[b"png"])
    _check_image_run(load_config(["preset=tiny"]), [row])  # nothing refused
    _check_image_run(load_config(["preset=tiny", "pipeline.mode=fully_async"]), [row])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=remax with image prompts"):
        _check_image_run(load_config(["preset=tiny", "algorithm.adv_estimator=remax"]), [row])
    row.agent_name = TOOL_AGENT
    with pytest.raises(ConfigError, match="row 0 has images and agent_name=tool_agent"):
        _check_image_run(load_config(["preset=tiny"]), [row])


@pytest.mark.heavy  # builds (once) the tiny_vl folder
def test_a_vision_language_folder_of_ones_own_is_checked_before_the_run():
    """A VL model given by its folder (not the alias), with data files: the config says images are coming
    (the folder's config.json), so what images do not support is refused before any worker starts."""
    from offstep.models.loading import resolve_model

    folder = resolve_model("tiny_vl")
    cfg = load_config([f"model.path={folder}", "data.train_files=[rows.parquet]", "rollout.engine=vllm"])
    assert images_expected(cfg)
    assert any("rollout.engine=vllm with image prompts" in p for p in problems(cfg)), problems(cfg)
    assert not images_expected(load_config(["model.path=tiny", "data.train_files=[rows.parquet]"]))
