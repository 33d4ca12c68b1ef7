"""The `netagent` command (`cli.main`): the one place every subcommand and flag is defined."""
