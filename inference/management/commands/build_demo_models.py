"""Build the demo target/draft pair into SPECOPS_MODEL_DIR and register it as model 'demo'."""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from inference.conf import conf
from inference.demo.builder import DemoBuildConfig, build_demo_models
from inference.registry import DEMO_NAME, RegistrationError, register_pair


class Command(BaseCommand):
    help = "Train the demo tokenizer, target and distilled draft (reused when already built), then register them."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--device", default="cpu", help="Device the registered versions run on (cpu or cuda:N).")
        parser.add_argument("--no-register", action="store_true", help="Only build the files.")

    def handle(self, *args, seed: int, device: str, no_register: bool, **options) -> None:
        try:
            built = build_demo_models(conf.MODEL_DIR, config=DemoBuildConfig(seed=seed), progress=True,
                                      cache_dir=conf.CACHE_DIR)
            if not no_register:
                target = register_pair(DEMO_NAME, f"seed{seed}", built.target_dir, built.draft_dir, device=device)
                self.stdout.write(f"registered {target} with draft {target.default_draft}")
        except (RegistrationError, OSError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"demo models ready: {built.target_dir} {built.draft_dir}")
