"""What earlier versions saved, brought to today's names: the one place that maps an old layout to the current one.
Three modules, each imported through this package: :mod:`~softvq._compat.state` (checkpoints),
:mod:`~softvq._compat.options` (former option names) and :mod:`~softvq._compat.records` (models' and commands'
records, and the commands' former flags).

- State dicts: each layer's ``_load_from_state_dict`` calls one function here (:func:`upgrade_ddcl_state`,
  :func:`upgrade_hard_state`, :func:`upgrade_standardizer_state`), so a checkpoint saved before the layers were
  composed of :mod:`softvq.parts` (its buffers at the layer's top level, under their former names), before the in-layer
  recipe (``DDCLQuantizer`` version 1) or before the standardiser kept its applied statistics loads into today's layer
  unchanged in value.
- The extra state (:func:`read_ddcl_extra_state`): ``DDCLQuantizer``'s of any version, read.
- Settings in the state (:func:`check_state_settings`): the settings that change a layer's result (each layer's
  ``_settings()``, in plain values: :func:`settings_record`), recorded in its extra state and compared when a state
  loads; a state that predates them loads unchecked.
- Options: a model's recorded ``quantizer_kwargs`` (:func:`upgrade_quantizer_kwargs`, when a checkpoint is loaded) and a
  run's recorded settings (:func:`upgrade_settings`, when a run is resumed) take today's option names, and a setting
  a record predates counts as the value it had then (:data:`PREDATED`); a constructor given a former name refuses it
  with the option that replaced it (:func:`refuse_former_options`).
- Models and commands: a prior's recorded config and hyperparameters (:func:`upgrade_prior_config`,
  :func:`upgrade_prior_hparams`), a run record's settings newer than the run (:func:`newer_settings`), and each
  command's former flags (:data:`FORMER_FLAGS`, :func:`former_flags`), which the commands refuse with their
  replacement and never translate.

Saving always writes today's layout and names.
"""

from softvq._compat.options import (  # noqa: F401 (the package's names)
    FORMER_OPTIONS,
    PREDATED,
    FormerOptionError,
    former_option_error,
    refuse_former_keywords,
    refuse_former_options,
    upgrade_quantizer_kwargs,
    upgrade_settings,
)
from softvq._compat.records import (  # noqa: F401 (the package's names)
    FORMER_FLAGS,
    former_flags,
    newer_settings,
    upgrade_prior_config,
    upgrade_prior_hparams,
)
from softvq._compat.state import (  # noqa: F401 (the package's names)
    PLAIN_SETTINGS,
    SETTINGS_VERSION,
    check_state_settings,
    former_auto_settings,
    read_ddcl_extra_state,
    settings_record,
    upgrade_ddcl_state,
    upgrade_hard_state,
    upgrade_standardizer_state,
    upgrade_state_dict,
)
