"""foreserve core library. Never imports ray at module level."""
