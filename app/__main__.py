import sys

# absolute imports: the bundle (packaging/dsv41-panel.spec) runs this file as a top-level script, not as a package
from engine_manager.frozen import restore_environment

restore_environment()

from app.main import main  # noqa: E402

sys.exit(main())
