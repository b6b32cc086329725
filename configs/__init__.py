"""The presets shipped with solrl (``*.yaml``, each a complete run or one that ``extends`` another) and their prompt
sets (``prompts/``).

``DEFAULT`` is the preset of a run given no ``--config``. It is also where the config schema takes the defaults that
name plug-ins (model family, explore backend, loss, rewards) or shipped data (prompt files), so the schema itself
names none.
"""

DEFAULT = "tiny-digits"
