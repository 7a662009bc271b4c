"""moe-shared-expert-phased: the shared expert split into phases interleaved with the routed path.

Qwen3-Next on SGLang (cann-recipes stage1 patch 0003) and DeepSeek-V3.2's GE decode path: instead
of one side block, the shared expert is written out step by step (its submodule inlined, every
nested call bound to a name) and issued in phases: the projections right away, the activation
after the first anchor (dispatch), the down projection and gate multiply after the second (expert
compute), so each side phase runs next to a different part of the routed path. Each phase waits
for all main work issued so far (`wait_stream`; `npu_wait_tensor` on the anchor in GE mode); the
main stream joins before the final add.

Anchors are `--anchor NAME` (repeat; main-stream values in program order) or, by default, the
results of the main-path steps before the last one. The edit is two patches: the inlining
refactor, then the phases; `-o patches/stage1/` writes them with an apply_patches.sh.

Modes: eager, ge-graph, cuda. Not npugraph-ex yet: each phase would need its own capture-stable
event pair; moe-shared-expert covers npugraph-ex in one phase.
"""

from __future__ import annotations

from msrewrite.cases import Case
from msrewrite.codemods.moe_shared_expert import describe, is_shared_expert_call

CASE = Case(
    name="moe-shared-expert-phased",
    summary="shared expert inlined and issued in phases between dispatch, expert compute and combine",
    modes=("eager", "ge-graph", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_expert",
    flag_name="ENABLE_MOE_SHARED_EXPERT_STREAM",
    describe=describe,
    what=("the shared expert", "the routed experts"),
    phased=True,
    notes="not npugraph-ex yet: phases would need capture-stable events each",
)
