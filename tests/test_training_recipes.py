"""Training recipes: the shipped ones load, options override them, bad keys are named."""

import pytest

from bmeg.paths import shipped_names
from bmeg.training.pipeline import TrainConfig, load_recipe

RECIPES = shipped_names("bmeg.training", "recipes")


def test_the_recipes_are_shipped():
    assert {"socialnet", "socialnet-mitigation", "socialnet-thesis", "hotelreservation"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_shipped_recipes_load_by_name(recipe):
    assert isinstance(load_recipe(recipe), TrainConfig)


def test_an_unknown_recipe_names_the_shipped_ones():
    with pytest.raises(ValueError, match="socialnet-mitigation"):
        load_recipe("no-such-recipe")


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
