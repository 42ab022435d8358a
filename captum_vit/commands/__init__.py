"""Sub-commands of the ``captum-vit`` command line."""
