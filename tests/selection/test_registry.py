import pytest
import torch

from sgl_pic.config import POLICY_FIELDS, PicConfig
from sgl_pic.layout import PromptLayout
from sgl_pic.registry import POLICIES
from sgl_pic.selection import (
    SelectionContext,
    SelectionPolicy,
    finalize,
    make_policy,
    policy_names,
    register_policy,
)

POLICY_NAMES = POLICIES.names()


def test_policy_names_come_from_the_registry() -> None:
    assert policy_names() == POLICY_NAMES
    assert "daric" in POLICY_NAMES and "cachetune" in POLICY_NAMES
    # approximation_key reads each policy's settings from POLICY_FIELDS.
    assert set(POLICY_FIELDS) == set(POLICY_NAMES)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_name_resolves_to_the_class_of_that_name(name: str) -> None:
    cls = POLICIES.get(name)
    assert issubclass(cls, SelectionPolicy) and cls.name == name
    assert register_policy(cls) is cls  # its own decorator again: not a duplicate


def test_a_second_policy_under_a_builtin_name_is_refused() -> None:
    class Impostor(SelectionPolicy):
        name = "daric"

    with pytest.raises(ValueError, match="policy 'daric' is already registered"):
        register_policy(Impostor)
    assert POLICIES.get("daric").__name__ == "Daric"


def test_unknown_policy_names_every_valid_choice() -> None:
    for fails in (lambda: make_policy(PicConfig(), "nope"), lambda: PicConfig(policy="nope")):
        with pytest.raises(ValueError, match="unknown policy 'nope'; valid policies: ") as err:
            fails()
        for name in POLICY_NAMES:
            assert name in str(err.value)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_name_builds_its_policy(name: str) -> None:
    by_config = make_policy(PicConfig(policy=name))
    by_argument = make_policy(PicConfig(), name)
    assert by_config.name == name
    assert type(by_argument) is type(by_config)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_gives_valid_indices(name: str) -> None:
    layout = PromptLayout.from_spans(40, [[0, 10], [12, 25], [25, 36]])
    rankings = tuple(
        torch.rand(s.length, generator=torch.Generator().manual_seed(1)) for s in layout.chunks
    )
    deviation = torch.rand(40, generator=torch.Generator().manual_seed(2))
    attention = torch.rand(40, generator=torch.Generator().manual_seed(3))
    ctx = SelectionContext(
        layout,
        rankings=rankings,
        deviation=lambda: deviation,
        query_attention=lambda: attention,
    )
    config = PicConfig(policy=name, daric_n_avg=4, epic_k=3, qa_min_tokens=2)
    idx = make_policy(config).select(ctx).indices
    assert idx.dtype == torch.int64
    assert torch.equal(idx, torch.unique(idx))
    assert idx.numel() == 0 or (idx.min() >= 0 and idx.max() < layout.num_tokens)
    final = finalize(make_policy(config).select(ctx), layout).indices
    assert set(layout.fresh_indices()) | {39} <= set(final.tolist())


@pytest.mark.parametrize("r", [0.0, -0.1, 1.01])
def test_config_rejects_daric_r_outside_unit_interval(r: float) -> None:
    with pytest.raises(ValueError, match="daric_r"):
        PicConfig(daric_r=r)


def test_config_accepts_r_of_one() -> None:
    assert PicConfig(daric_r=1.0).daric_r == 1.0


def test_config_rejects_negative_n_avg() -> None:
    with pytest.raises(ValueError, match="daric_n_avg"):
        PicConfig(daric_n_avg=-1.0)


@pytest.mark.parametrize("alpha", [0.0, 1.5, -1.0])
def test_config_rejects_alpha_outside_unit_interval(alpha: float) -> None:
    with pytest.raises(ValueError, match="cachetune_alpha"):
        PicConfig(cachetune_alpha=alpha)


@pytest.mark.parametrize("field", ["cachetune_r", "cacheblend_ratio"])
def test_config_rejects_ratios_outside_unit_interval(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PicConfig(**{field: 0.0})


def test_config_rejects_unknown_mtaf() -> None:
    with pytest.raises(ValueError, match="unknown MTAF 'quadratic'.*linear, log, exp"):
        PicConfig(daric_mtaf="quadratic")
