from django.db import migrations, models


class Migration(migrations.Migration):
    """Crash safety: the lease a worker holds on a running session, and how often it was claimed."""

    dependencies = [("metadata", "0005_token_kind_correction")]

    operations = [
        migrations.AddField(model_name="session", name="attempts",
                            field=models.PositiveSmallIntegerField(default=0)),
        migrations.AddField(model_name="session", name="lease_expires_at",
                            field=models.DateTimeField(blank=True, null=True)),
        migrations.AddField(model_name="session", name="worker",
                            field=models.CharField(blank=True, default="", max_length=128)),
    ]
