"""Training recipes: the shipped ones load, options override them, bad keys are named."""

from pathlib import Path

import pytest

from bmeg.training.pipeline import TrainConfig, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "training").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_shipped_recipes_load(recipe):
    assert isinstance(load_recipe(recipe), TrainConfig)


def test_overrides_win_over_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset: socialnet\ntraces: 100\nfit: {epochs: 3, loss: focal}\n")
    config = load_recipe(recipe, traces=50, fit={"epochs": 1})
    assert (config.traces, config.fit.epochs, config.fit.loss) == (50, 1, "focal")


def test_unknown_keys_and_values_are_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset: socialnet\nlearning_rate: 3\n")
    with pytest.raises(ValueError, match="learning_rate"):
        load_recipe(recipe)
    recipe.write_text("fit: {loss: magic}\n")
    with pytest.raises(ValueError, match="unknown loss 'magic'"):
        load_recipe(recipe)
