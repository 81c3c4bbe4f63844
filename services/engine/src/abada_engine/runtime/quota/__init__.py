"""Model quotas: admission of model calls against shared windows."""
