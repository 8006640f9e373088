"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

# Does more than add to the schema: it makes the schema.
ADDITIVE = False


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('revoked_at', sa.TIMESTAMP(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    op.create_table('findings',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('group_key', sa.Text(), nullable=True),
    sa.Column('op', sa.String(length=32), nullable=True),
    sa.Column('nodes', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('opened_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_seen_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('resolved_at', sa.TIMESTAMP(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_findings'))
    )
    op.create_index('ix_findings_status_kind', 'findings', ['status', 'kind'], unique=False)
    op.create_table('link_health',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('group_key', sa.Text(), nullable=False),
    sa.Column('op', sa.String(length=32), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('members', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('nodes', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('busbw_gbs', sa.Float(), nullable=False),
    sa.Column('expected_gbs', sa.Float(), nullable=True),
    sa.Column('ratio', sa.Float(), nullable=True),
    sa.Column('bad_streak', sa.Integer(), nullable=False),
    sa.Column('good_streak', sa.Integer(), nullable=False),
    sa.Column('updated_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('changed_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_link_health')),
    sa.UniqueConstraint('group_key', 'op', name='uq_link_health_group_op')
    )
    op.create_table('nodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=True),
    sa.Column('backend', sa.String(length=16), nullable=True),
    sa.Column('first_seen_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_seen_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes')),
    sa.UniqueConstraint('name', name=op.f('uq_nodes_name'))
    )
    op.create_table('outbox_events',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('event_type', sa.String(length=64), nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('dispatched_at', sa.TIMESTAMP(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox_events'))
    )
    op.create_index(op.f('ix_outbox_events_dispatched_at'), 'outbox_events', ['dispatched_at'], unique=False)
    op.create_table('probe_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('batch_id', sa.String(length=128), nullable=False),
    sa.Column('backend', sa.String(length=16), nullable=False),
    sa.Column('received_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('measurement_count', sa.Integer(), nullable=False),
    sa.Column('findings', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_probe_runs')),
    sa.UniqueConstraint('batch_id', name=op.f('uq_probe_runs_batch_id'))
    )
    op.create_table('webhooks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('secret', sa.Text(), nullable=False),
    sa.Column('events', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('format', sa.String(length=16), nullable=False),
    sa.Column('active', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhooks'))
    )
    op.create_table('gpus',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.Integer(), nullable=False),
    sa.Column('local_index', sa.Integer(), nullable=False),
    sa.Column('uuid', sa.String(length=64), nullable=True),
    sa.Column('pci_bus_id', sa.String(length=32), nullable=True),
    sa.Column('numa_node', sa.Integer(), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('telemetry', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('updated_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_gpus_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gpus')),
    sa.UniqueConstraint('node_id', 'local_index', name='uq_gpus_node_local')
    )
    op.create_table('measurements',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('time', sa.TIMESTAMP(timezone=True), nullable=False),
    sa.Column('backend', sa.String(length=16), nullable=False),
    sa.Column('op', sa.String(length=32), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('group_key', sa.Text(), nullable=False),
    sa.Column('members', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('nodes', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('dtype', sa.String(length=16), nullable=False),
    sa.Column('warmup', sa.Integer(), nullable=False),
    sa.Column('iters', sa.Integer(), nullable=False),
    sa.Column('time_us', sa.Float(), nullable=False),
    sa.Column('algbw_gbs', sa.Float(), nullable=False),
    sa.Column('busbw_gbs', sa.Float(), nullable=False),
    sa.Column('wrong', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['probe_runs.id'], name=op.f('fk_measurements_run_id_probe_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_measurements'))
    )
    op.create_index(op.f('ix_measurements_run_id'), 'measurements', ['run_id'], unique=False)
    op.create_index('ix_measurements_series', 'measurements', ['group_key', 'op', 'size_bytes', 'time'], unique=False)
    op.create_index('ix_measurements_time', 'measurements', ['time'], unique=False)
    op.create_table('webhook_deliveries',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('webhook_id', sa.Integer(), nullable=False),
    sa.Column('event_id', sa.BigInteger(), nullable=False),
    sa.Column('delivery_id', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_status_code', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('delivered_at', sa.TIMESTAMP(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['event_id'], ['outbox_events.id'], name=op.f('fk_webhook_deliveries_event_id_outbox_events'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['webhook_id'], ['webhooks.id'], name=op.f('fk_webhook_deliveries_webhook_id_webhooks'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries')),
    sa.UniqueConstraint('delivery_id', name=op.f('uq_webhook_deliveries_delivery_id')),
    sa.UniqueConstraint('webhook_id', 'event_id', name='uq_webhook_deliveries_webhook_event')
    )
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['status', 'next_attempt_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries')
    op.drop_table('webhook_deliveries')
    op.drop_index('ix_measurements_time', table_name='measurements')
    op.drop_index('ix_measurements_series', table_name='measurements')
    op.drop_index(op.f('ix_measurements_run_id'), table_name='measurements')
    op.drop_table('measurements')
    op.drop_table('gpus')
    op.drop_table('webhooks')
    op.drop_table('probe_runs')
    op.drop_index(op.f('ix_outbox_events_dispatched_at'), table_name='outbox_events')
    op.drop_table('outbox_events')
    op.drop_table('nodes')
    op.drop_table('link_health')
    op.drop_index('ix_findings_status_kind', table_name='findings')
    op.drop_table('findings')
    op.drop_table('api_tokens')
