"""A tenant's prefix cache group: tenants an operator groups share cached prompt prefixes; every
other tenant's are its own (the prefix cache's trust boundary is the tenant)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('metadata', '0015_tenant_quotas'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='prefix_cache_group',
            field=models.SlugField(blank=True, db_index=False, default='', help_text="tenants with the same group share cached prompt prefixes, and so learn from cache hits what the others sent; empty: this tenant's cached prefixes are its own", max_length=64),
        ),
    ]
