import pytest
from rankscope import RankIdentity


def test_identity_is_read_from_torchrun_environment():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "job-7"}
    identity = RankIdentity.from_env(env, node="host-b")
    assert (identity.rank, identity.local_rank, identity.world_size, identity.node_rank) == (3, 1, 4, 1)
    assert identity.labels() == {"run_id": "job-7", "rank": "3", "local_rank": "1", "node": "host-b"}


def test_explicit_arguments_override_the_environment():
    env = {"RANK": "0", "WORLD_SIZE": "2", "RANKSCOPE_RUN_ID": "from-env"}
    identity = RankIdentity.from_env(env, rank=1, run_id="explicit", node="n")
    assert identity.rank == 1 and identity.run_id == "explicit"


def test_rankscope_run_id_wins_over_torchrun_and_placeholder_is_ignored():
    assert RankIdentity.from_env({"RANKSCOPE_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "x"}, node="n").run_id == "mine"
    assert RankIdentity.from_env({"TORCHELASTIC_RUN_ID": "none"}, node="n").run_id == "local"


def test_no_environment_means_a_single_local_rank():
    identity = RankIdentity.from_env({}, node="n")
    assert (identity.rank, identity.local_rank, identity.world_size) == (0, 0, 1)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x"}, "RANK must be an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in"),
        ({"RANKSCOPE_RUN_ID": "has space"}, "run_id must be"),
    ],
)
def test_bad_identity_fails_with_a_message_naming_the_problem(env, message):
    with pytest.raises(ValueError, match=message):
        RankIdentity.from_env(env, node="n")


def test_the_node_rank_falls_back_to_lightnings_node_rank_and_can_be_given():
    # Lightning's launcher sets NODE_RANK (not torchrun's GROUP_RANK); a framework's own ranks win.
    assert RankIdentity.from_env({"NODE_RANK": "2", "WORLD_SIZE": "8"}).node_rank == 2
    given = RankIdentity.from_env({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, rank=1, node_rank=0)
    assert (given.rank, given.local_rank, given.node_rank) == (1, 1, 0)
