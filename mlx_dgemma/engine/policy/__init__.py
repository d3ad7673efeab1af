"""Hardware-aware step policy, by role: ``roofline`` (what a step and a token cost on a known device),
``profile`` (those costs measured here and cached on disk), ``observed`` (that profile refreshed from
the forwards the engine runs), ``acceptance`` (verified drafting's
running estimate), ``plan`` (a plan and the fixed policies' plans) and ``auto`` (the planner that
re-chooses as it generates). The names the rest of the package imports are re-exported here."""

from .acceptance import Acceptance, best_draft
from .auto import EXPLORE_EVERY, EXPLORE_WITHIN, PLANNERS, AutoPlanner, Planners, auto_planner, make_plan
from .observed import LiveProfile
from .plan import POLICIES, DraftRequest, Plan
from .profile import (
    CANVAS_LENGTHS,
    DRAFT_LENGTHS,
    Profile,
    cached_profile,
    isotonic,
    live_profile_store,
    measure,
    profile_cache_path,
    store_profile,
    time_canvas,
)
from .roofline import (
    KNOWN_DEVICES,
    RELEASED,
    Cost,
    forward_cost,
    parameter_count,
    predict,
    predicted_seconds,
    predicted_table,
)

__all__ = [
    "CANVAS_LENGTHS",
    "DRAFT_LENGTHS",
    "EXPLORE_EVERY",
    "EXPLORE_WITHIN",
    "KNOWN_DEVICES",
    "PLANNERS",
    "POLICIES",
    "RELEASED",
    "Acceptance",
    "AutoPlanner",
    "LiveProfile",
    "Planners",
    "Cost",
    "DraftRequest",
    "Plan",
    "Profile",
    "auto_planner",
    "best_draft",
    "cached_profile",
    "forward_cost",
    "isotonic",
    "live_profile_store",
    "make_plan",
    "measure",
    "parameter_count",
    "predict",
    "predicted_seconds",
    "predicted_table",
    "profile_cache_path",
    "store_profile",
    "time_canvas",
]
