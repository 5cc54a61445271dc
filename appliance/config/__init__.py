"""The config tree: schema, composition, validation, plan (see docs/architecture.md).

Import the modules themselves (``appliance.config.compose.resolve``): this
package imports nothing, so its modules can import one another's
neighbours without a cycle through it."""
