"""``fairseq-hydra-train`` with the plugin loaded before the config is read::

    python -m fairseq_fp16.hydra_train --config-dir DIR --config-name NAME [key=value ...]

fairseq-hydra-train merges a config's ``task:`` section into the task's registered dataclass
(``add_defaults``) before it imports ``common.user_dir``, so with the stock command a plugin
key under ``task:`` (``scale_trace``, ``fused_loss``...) is refused as not in the task's config.
Run so, the plugin (imported with this module's package) has extended every task's dataclass
first; everything else is fairseq-hydra-train's.
"""

from fairseq_cli.hydra_train import cli_main

if __name__ == "__main__":
    cli_main()
