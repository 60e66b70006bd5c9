"""Shared fixtures, and the suite's layers.

Every test file belongs to one layer, given by the heaviest machinery its tests start
(a test marked with another layer in place keeps that one):

* ``unit``: one process, no process group;
* ``multiprocess``: several ranks through the library (the shared gloo pool, spawned or
  child processes);
* ``e2e``: ddpkit's CLI, its launcher or the example programs, run as a user runs them.

``slow`` (orthogonal to the layer) marks what ``pytest -m "not slow"`` leaves out to stay
under a minute on a 2-core machine: the tests in SLOW below, the suite's slowest by
``--durations`` (mostly a fresh interpreter importing torch, or a timeout waited out),
and the 3- and 4-rank variants of sweeps also run on 2 ranks, plus those marked in
place. ``tests/test_suite_lists.py`` checks that every id in SLOW still names a test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dist_pool import DistPool, stop_fork_server  # noqa: E402
from train_reference import train_in_pool  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Exact mode's sum compiles its passes (seconds in every new process); tests where the
# compile is beside the point run them eager, which gives the same bits
# (tests/test_exact_compile.py compares the two).
os.environ.setdefault("DDPKIT_EXACT_COMPILE", "0")

UNIT, MULTIPROCESS, E2E = "unit", "multiprocess", "e2e"
LAYERS = {
    "test_bad_inputs.py": UNIT,
    "test_checkpoint_damage.py": UNIT,
    "test_cli.py": UNIT,
    "test_doc_commands.py": UNIT,
    "test_doc_links.py": UNIT,
    "test_layers.py": UNIT,
    "test_architecture_table.py": UNIT,
    "test_private_writes.py": UNIT,
    "test_suite_lists.py": UNIT,
    "test_metric_log.py": UNIT,
    "test_data_datasets.py": UNIT,
    "test_data_partition.py": UNIT,
    "test_elastic_parts.py": UNIT,
    "test_ddp_buckets.py": UNIT,
    "test_exact_sum.py": UNIT,
    "test_shm_barrier.py": UNIT,
    "test_exact_compile.py": UNIT,
    "test_readme.py": UNIT,
    "test_shard_layout.py": UNIT,
    "test_topology.py": UNIT,
    "test_train_config.py": UNIT,
    "test_vocabulary.py": E2E,
    "test_world.py": UNIT,
    "test_checkpoint.py": MULTIPROCESS,
    "test_checkpoint_crash.py": MULTIPROCESS,
    "test_checkpoint_dcp.py": MULTIPROCESS,
    "test_init_from.py": MULTIPROCESS,
    "test_clean_exit.py": MULTIPROCESS,
    "test_comm.py": MULTIPROCESS,
    "test_comm_async.py": MULTIPROCESS,
    "test_comm_errors.py": MULTIPROCESS,
    "test_comm_fast_path.py": MULTIPROCESS,
    "test_comm_hierarchical.py": MULTIPROCESS,
    "test_comm_torch_convention.py": MULTIPROCESS,
    "test_compat_ddp.py": MULTIPROCESS,
    "test_compat_table.py": MULTIPROCESS,
    "test_ddp.py": MULTIPROCESS,
    "test_ddp_comm.py": MULTIPROCESS,
    "test_ddp_steady_state.py": MULTIPROCESS,
    "test_exact.py": MULTIPROCESS,
    "test_exact_batchnorm.py": MULTIPROCESS,
    "test_exact_order.py": MULTIPROCESS,
    "test_fault.py": MULTIPROCESS,
    "test_lifetime.py": MULTIPROCESS,
    "test_loop_rank0.py": MULTIPROCESS,
    "test_logging.py": MULTIPROCESS,
    "test_plan.py": MULTIPROCESS,
    "test_runtime.py": MULTIPROCESS,
    "test_shm.py": MULTIPROCESS,
    "test_train_fault_api.py": MULTIPROCESS,
    "test_train_metrics.py": MULTIPROCESS,
    "test_train_recipe.py": MULTIPROCESS,
    "test_train_resume.py": MULTIPROCESS,
    "test_verify.py": MULTIPROCESS,
    "test_zero.py": MULTIPROCESS,
    "test_zero3.py": MULTIPROCESS,
    "test_torch_ddp_suite.py": MULTIPROCESS,
    "test_torch_collective_suite.py": MULTIPROCESS,
    "test_torch_swap.py": MULTIPROCESS,
    "test_torch_route_fast.py": MULTIPROCESS,
    "test_dist_pool.py": MULTIPROCESS,
    "test_comm_bench.py": E2E,
    "test_worker_heap.py": E2E,
    "test_ddp_examples.py": E2E,
    "test_docs.py": E2E,
    "test_elastic.py": E2E,
    "test_env_cmd.py": E2E,
    "test_exact_cli.py": E2E,
    "test_gpu_check.py": E2E,
    "test_examples.py": E2E,
    "test_launch.py": E2E,
    "test_console.py": E2E,
    "test_launch_torchrun.py": E2E,
    "test_migrating.py": E2E,
    "test_mpi.py": E2E,
    "test_multinode.py": E2E,
    "test_own_loop.py": E2E,
    "test_slurm.py": E2E,
    "test_slurm_launcher.py": E2E,
    "test_train_e2e.py": E2E,
    "test_train_example.py": E2E,
    "test_train_fault.py": E2E,
    "test_frameworks.py": E2E,
    "test_run_all.py": E2E,
}
# The files whose tests take longest in all (--durations, benchmarks/RESULTS.md "Test suite"),
# longest first: they are collected first, so that the two xdist workers (whole files
# each, in collection order: pyproject's addopts) start them first and share out the
# short files at the end, instead of one worker taking a long file while the other idles.
LONGEST_FIRST = (
    "test_docs.py", "test_frameworks.py", "test_elastic.py", "test_gpu_check.py",
    "test_own_loop.py", "test_train_fault.py", "test_slurm_launcher.py",
    "test_launch_torchrun.py", "test_migrating.py", "test_slurm.py", "test_exact_cli.py",
    "test_console.py", "test_train_e2e.py", "test_launch.py", "test_comm.py",
)
# file -> test functions (every parametrization) or single parametrizations ("name[id]").
# Four ranks on two cores: every test on the 4-rank pool is slow, and so is starting it.
SLOW = {
    "test_bad_inputs.py": {
        "test_a_run_whose_loss_turns_non_finite_stops_and_keeps_the_last_good_checkpoint"},
    "test_checkpoint_crash.py": {"test_killed_writer_leaves_previous_checkpoint_chosen"},
    "test_clean_exit.py": {"test_no_process_group_thread_is_left_at_exit",
                           "test_repeated_runs_exit_clean"},
    "test_comm.py": {"test_large_tensors_cross_many_segments", "test_subgroups_match_torch",
                     "test_all_reduce_matches_torch[4]",
                     "test_reduce_scatter_and_all_gather_match_torch[3]",
                     "test_reduce_scatter_and_all_gather_match_torch[4]",
                     "test_broadcast_and_reduce_match_torch[3]"},
    "test_comm_bench.py": {"test_cli_sweep_prints_table_and_writes_files"},
    "test_comm_errors.py": {"test_auto_across_fake_hosts_is_hierarchical_or_backend"},
    "test_comm_torch_convention.py": {"test_torch_positional_order_means_the_same[3]",
                                      "test_complex_at_three_ranks"},
    "test_comm_fast_path.py": {"test_route_is_taken_checked_in_band_and_forgotten"},
    "test_comm_hierarchical.py": {"test_every_collective_matches_torch_on_fake_hosts",
                                  "test_leaders_group_is_made_when_ranks_hold_different_groups",
                                  "test_public_door_is_hierarchical_not_a_silent_backend_fallback"},
    "test_compat_ddp.py": {"test_torch_compile_of_the_wrapped_model_trains_like_torch_ddp",
                           "test_torch_ddp_scripts_at_three_ranks_with_defaults_agree_to_rounding",
                           "test_misuse_raises_torchs_exception_type_with_ddpkits_message[3]",
                           "test_torch_ddp_scripts_give_bit_identical_parameters"},
    "test_ddp.py": {"test_uneven_inputs_without_join_time_out_with_an_error",
                    "test_three_ranks_equal_one_process"},
    "test_ddp_comm.py": {"test_every_comm_keeps_replicas_identical_and_equals_one_process",
                         "test_bad_comm_is_one_line_exit_2[verify]",
                         "test_verify_passes_with_every_comm[4]",
                         "test_backend_comm_is_bit_identical_to_torch_ddp[4]"},
    "test_ddp_steady_state.py": {"test_default_comm_step_makes_no_backend_call[3]",
                                 "test_uneven_inputs_under_join_shm_equals_backend[3]"},
    "test_ddp_examples.py": {"test_basic_demo_on_ddpkit_engine_keeps_replicas_identical"},
    # Pages whose blocks start ranks or run `ddpkit train`; pages without runnable blocks
    # (and a new page, until it is listed here) stay in the fast set.
    "test_docs.py": {f"test_page_runs[{page}]" for page in (
        "README.md", "docs/checkpoints.md", "docs/collectives.md", "docs/ddp-engine.md",
        "docs/exact.md", "docs/multinode.md", "docs/own-loop.md", "docs/shm.md",
        "docs/training.md")},
    "test_env_cmd.py": {"test_version_prints_installed_version",
                        "test_env_reports_versions_backends_and_distributed_variables"},
    "test_exact.py": {"test_main_job_ends_with_the_same_bits_at_every_world_size",
                      "test_the_default_mode_is_not_bit_identical_across_world_sizes",
                      "test_stopped_at_two_ranks_and_continued_on_one_ends_with_the_same_bits",
                      "test_verify_exact_finds_zero_difference_with_dropout_and_catches_per_rank_streams",
                      "test_run_with_a_dataloader_continues_at_another_world_size_with_the_same_bits",
                      "test_slices_that_skip_a_branch_give_the_same_gradients_at_every_world_size"},
    "test_exact_cli.py": {
        "test_sigterm_at_two_ranks_then_resume_at_three_ends_with_one_process_bits"},
    "test_gpu_check.py": {"test_rehearsal_runs_every_item_and_the_bits_match"},
    "test_examples.py": {"test_every_collective_under_launch_three_ranks",
                         "test_ddp_basic_spawn_keeps_replicas_identical"},
    "test_fault.py": {"test_barrier_timeout_names_the_sleeping_rank",
                      "test_collective_timeout_names_the_missing_rank",
                      "test_backstop_exits_the_process_with_the_hang_code",
                      "test_a_rank_that_was_stopped_says_so_instead_of_blaming_its_peers"},
    "test_worker_heap.py": {"test_a_launched_worker_gets_them",
                            "test_a_process_not_started_by_the_launcher_gets_them_from_data_parallel"},
    "test_launch.py": {"test_spmd_example_under_launch", "test_failing_rank_reported_once",
                       "test_missing_script_is_one_line", "test_invalid_nproc",
                       "test_rendezvous_port_in_use_is_one_line",
                       "test_a_killed_rank_is_named_not_the_survivor_the_agent_stopped",
                       "test_unreachable_rendezvous_is_one_line_without_frame_dumps"},
    "test_console.py": {"test_train_users_factories_with_progress_lines_when_not_a_terminal",
                             "test_train_on_a_terminal_prints_lines_for_a_person_and_one_live_line"},
    "test_launch_torchrun.py": {"test_same_command_line_same_ranks_as_torchrun",
                                "test_output_options_same_console_and_log_files",
                                "test_failing_rank_is_named_with_its_role",
                                "test_unknown_flag_is_one_line_as_torchrun_also_refuses_it"},
    "test_migrating.py": {
        "test_torch_ddp_script_with_one_import_changed_trains_as_under_torchrun",
        "test_mp_spawn_program_and_its_ddpkit_version_train_the_same_under_spawn_and_launch",
        "test_accelerate_style_script_on_two_processes_equals_one_and_gathers_metrics",
        "test_device_ids_on_a_cpu_module_is_one_line_per_rank_and_exit_2"},
    "test_logging.py": {"test_import_adds_only_a_null_handler_and_keeps_propagation",
                        "test_basicconfig_file_sees_ddpkit_messages",
                        "test_cli_marked_processes_log_to_stderr"},
    "test_own_loop.py": {"test_uninterrupted_run_learns_and_logs",
                         "test_killed_worker_is_restarted_and_the_run_ends_bit_identical",
                         "test_sigterm_stops_every_rank_with_a_checkpoint_and_the_same_command_resumes",
                         "test_a_rank_that_stops_arriving_is_named"},
    "test_runtime.py": {"test_init_methods", "test_spawn_reraises_child_exception_with_rank",
                        "test_groups_built_again_in_the_same_ranks_meet_on_fresh_keys",
                        "test_port_in_use_is_one_line", "test_world_size_mismatch_is_one_line"},
    "test_shm.py": {"test_hierarchical_across_fake_hosts_matches_torch",
                    "test_segment_of_a_killed_rank_is_removed_at_restart",
                    "test_public_default_is_hierarchical_across_fake_hosts",
                    "test_broadcast_gather_scatter_reduce_match_torch[3-sizes1-dtypes1]",
                    "test_broadcast_gather_scatter_reduce_match_torch[4-sizes2-dtypes2]",
                    "test_public_default_collectives_match_torch[3]",
                    "test_public_default_collectives_match_torch[4]"},
    "test_slurm_launcher.py": {
        "test_preempted_train_is_requeued_and_ends_like_one_uninterrupted_node",
        "test_two_nodes_rendezvous_and_a_failed_worker_is_restarted",
        "test_usr1_reaches_every_worker_through_the_agents_and_requeues"},
    "test_train_fault_api.py": {
        "test_resume_at_another_world_size_keeps_data_position_and_optimizer"},
    "test_init_from.py": {
        "test_a_rerun_of_an_init_from_command_after_a_preemption_continues_its_own_run"},
    "test_train_fault.py": {"test_killed_worker_is_restarted_and_the_run_ends_bit_identical",
                            "test_killed_launcher_and_sigterm_each_end_and_the_same_command_"
                            "continues",
                            "test_full_disk_at_a_checkpoint_is_one_line_no_restart_and_no_debris",
                            "test_a_full_disk_in_any_writer_is_one_line_and_final",
                            "test_a_stopped_rank_is_named_within_the_timeout_and_every_process_"
                            "ends"},
    # collects the files named here in a fresh interpreter
    "test_suite_lists.py": {"test_every_slow_id_names_a_collected_test"},
    "test_train_recipe.py": {"test_user_factories_train_the_users_module_on_the_users_data"},
    "test_train_e2e.py": {"test_sharded_run_equals_unsharded_with_half_the_optimizer_state",
                          "test_shard_with_the_torch_engine_is_one_line_exit_2"},
    "test_zero.py": {"test_sharded_checkpoint_resumes_at_another_world_size",
                     "test_run_resumes_a_sharded_loop_at_another_world_size",
                     "test_unsharded_and_sharded_checkpoints_continue_either_way",
                     "test_sharded_training_is_bit_identical_to_unsharded[3-auto]",
                     "test_sharded_training_is_bit_identical_to_unsharded[3-backend]"},
    # torch's own suites: each worker imports torch's test module once (seconds).
    "test_torch_ddp_suite.py": {"test_torch_ddp_test_passes_with_ddpkit",
                                "test_census_every_cpu_ddp_test_of_torch_is_in_the_suite"},
    "test_torch_collective_suite.py": {"test_torch_collective_test_passes_with_ddpkit_comm",
                                       "test_census_every_cpu_collective_test_is_in_the_suite",
                                       "test_torch_collective_test_passes_with_torchs_names_"
                                       "routed_to_ddpkit",
                                       "test_a_torch_test_that_sets_the_debug_level_leaves_the_"
                                       "worker_as_it_was"},
    # a pool of its own (two interpreters importing torch), one of them crashing
    "test_dist_pool.py": {
        "test_a_rank_that_crashes_is_named_with_its_signal_and_stack_not_waited_for"},
    # an interpreter that imports torch, to see what else it imports
    "test_checkpoint_damage.py": {
        "test_the_launchers_look_at_a_stopped_run_reads_manifests_without_importing_dcp"},
    "test_torch_swap.py": {"test_torch_names_give_ddpkit_engine_that_is_also_torchs_class"},
    # every test here starts interpreters that import torch (and most, a framework)
    "test_frameworks.py": {
        "test_accelerate_script_trains_as_under_torch_ddp",
        "test_transformers_trainer_trains_as_under_torch_ddp",
        "test_lightning_trains_as_under_torch_ddp",
        "test_a_rank_that_raises_inside_the_framework_is_named",
        "test_the_engine_variable_swaps_before_the_program_and_costs_nothing_unset",
        "test_a_bad_engine_variable_is_one_line",
        "test_launch_engine_torch_keeps_torchs_class_and_collectives"},
    # nearly all of its time is the first import of torch._dynamo (by torch.optim.SGD).
    "test_train_resume.py": {"test_workers_refuse_a_checkpoint_written_with_other_settings"},
}
REQUIRE_ALL = "DDPKIT_REQUIRE_ALL"  # .ci/run sets it to 1


def skip_unless_required(reason: str) -> NoReturn:
    """Skip a test whose system prerequisite (root, iproute2, OpenMPI) is missing; where
    DDPKIT_REQUIRE_ALL=1 (CI) fail it instead, so CI cannot go green without running it."""
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ALL}=1 requires this test to run)", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: the other files, and the tests inside each file, keep their order
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    for item in items:
        name = item.path.name
        layer = LAYERS.get(name)
        if layer is None:
            # Loud, but only for that file: other files keep running. (A usefixtures
            # marker added here would be ignored: fixtures were resolved at collection.)
            item.fixturenames.append("_layer_missing")
        elif not any(item.get_closest_marker(m) for m in (UNIT, MULTIPROCESS, E2E)):
            item.add_marker(getattr(pytest.mark, layer))
        slow = SLOW.get(name, ())
        if item.originalname in slow or item.name in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def _layer_missing(request):
    pytest.fail(f"{request.node.path.name} has no layer in LAYERS (tests/conftest.py)",
                pytrace=False)


@pytest.fixture(scope="session")
def pools():
    """pools(W) -> a DistPool of W gloo ranks, shared by the whole session."""
    made: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in made:
            made[world_size] = DistPool(world_size)
        return made[world_size]

    yield get
    for pool in made.values():  # all pools wind down at once, then each is waited for
        pool.ask_to_stop()
    for pool in made.values():
        pool.close()
    stop_fork_server()


@pytest.fixture(scope="session")
def train_reference(pools, tmp_path_factory):
    """train_reference(world_size, argv) -> the run directory of the uninterrupted
    ``ddpkit train`` job with options ``argv`` (no launcher options) on that many pooled
    ranks, trained once per session for every test that compares with it."""
    made: dict[tuple[int, tuple[str, ...]], Path] = {}

    def get(world_size: int, argv: list[str]) -> Path:
        key = (world_size, tuple(argv))
        if key not in made:
            run = tmp_path_factory.mktemp("train-reference") / "run"
            steps = pools(world_size).run(train_in_pool, list(argv), str(run), timeout=300)
            assert len(set(steps)) == 1 and steps[0] > 0, steps
            made[key] = run
        return made[key]

    return get


@pytest.fixture
def clean_env(monkeypatch):
    """An environment with no launcher variables, for World parsing tests."""
    for key in list(os.environ):
        if key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ) or key.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")):
            monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture(autouse=True)
def _cli_logging_mark_stays_in_its_test():
    """A test that runs the ddpkit command in-process marks os.environ so that processes
    it launches log like the command's workers; later tests' children must not inherit
    that mark by accident (a test relying on it would pass only after such a test)."""
    from ddpkit.log import _CLI_MARK

    before = os.environ.get(_CLI_MARK)
    yield
    if before is None:
        os.environ.pop(_CLI_MARK, None)
    else:
        os.environ[_CLI_MARK] = before
